"""Wiring of a pipeline: the rank grid, per-stage sub-meshes, point-to-point pairs, shared parameters, the
loss reported to every rank, and the optimizer restricted to a rank's stages."""
from __future__ import annotations

import numpy as np
import paddle

from .shared_params import shared_parameters as _shared_parameters

PIPE, DATA, MODEL = "pipe", "data", "model"


def _simulated_stage_meshes(stages, ranks: np.ndarray, tp_plan) -> dict:
    """The simulated world: every stage laid out on its own [data, model] sub-mesh, here; {stage: mesh}."""
    pp = ranks.shape[0]
    shared = _shared_parameters(stages, pp)
    if shared:
        names = sorted({n for _, by_stage in shared for n in by_stage.values()})
        raise NotImplementedError(f"parameters shared by stages on different pipeline ranks ({', '.join(names)}) "
                                  f"cannot be laid out on two stage meshes of one simulated world with data or "
                                  f"tensor parallelism inside stages; untie them, or run on real ranks")
    meshes = _stage_meshes(ranks)
    out = {}
    for st in stages:
        out[st.index] = meshes[st.index % pp]
        _shard_stage(st, out[st.index], tp_plan)
    return out


def _simulated() -> bool:
    from autoparallel.comm.world import current_world

    return current_world().is_simulated


def _world() -> tuple:
    import os

    from autoparallel.comm.world import current_world

    w = current_world()
    if w.is_simulated:
        return w.world_size, 0
    if not getattr(w, "initialized", True) and int(os.environ.get("PADDLE_TRAINERS_NUM", "1") or 1) > 1:
        raise RuntimeError("this process is one of several launched ranks but paddle.distributed is not "
                           "initialised; call paddle.distributed.init_parallel_env() before apply_pp")
    return w.world_size, w.rank


def _model_info(model) -> dict:
    from autoparallel.parallel.model_families import model_info

    return model_info(model)


def _check_composable(strategy, degrees) -> None:
    if degrees is None:
        raise ValueError("apply_pp needs resolved degrees: auto_mode='full' leaves them to the planner; "
                         "use auto_mode='semi' with pipeline_parallel.degree set")
    if degrees.pp < 2:
        raise ValueError(f"apply_pp needs pipeline_parallel.degree >= 2, got {degrees.pp}")
    if strategy.sharding.enable:
        _check_zero(strategy, degrees)


def _check_zero(strategy, degrees) -> None:
    """ZeRO stage 1 / 2 runs inside the stages (zero.py); stage 3 and ZeRO on plain stages are refused."""
    stage = strategy.sharding.stage
    if stage == 3:
        raise NotImplementedError("sharding stage 3 (parameters sharded over the data ranks and gathered around "
                                  "each layer's use) is not composed with pipeline parallelism; stages 1 "
                                  "(optimizer states) and 2 (also gradients) run inside the pipeline stages: set "
                                  "strategy.sharding.stage = 1 or 2")
    if degrees.dp * degrees.tp == 1:
        raise ValueError(f"sharding (ZeRO stage {stage}) with pipeline parallelism shards each stage's optimizer "
                         f"states over the stage's data ranks, but data_parallel.degree=1 and "
                         f"tensor_parallel.degree=1 leave every stage on one rank; set data_parallel.degree >= 2 or "
                         f"turn sharding off")


def zero_config(strategy):
    """(stage, degree, offload) of ``strategy.sharding`` for ``bind_optimizer``; None when off."""
    sh = strategy.sharding
    return (sh.stage, sh.degree or None, bool(sh.offload)) if sh.enable else None


def pipeline_ranks(pp: int, dp: int = 1, tp: int = 1, mesh=None) -> np.ndarray:
    """Global ranks as a ``[pipe, data, model]`` array: the default layout, or ``mesh`` reordered."""
    if mesh is None:
        return np.arange(pp * dp * tp).reshape(pp, dp, tp)
    from autoparallel.mesh import ProcessMesh

    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"mesh must be an ap.ProcessMesh, got {type(mesh).__name__}")
    dims = mesh.dim_names
    if PIPE not in dims or not set(dims) <= {PIPE, DATA, MODEL}:
        raise ValueError(f"a pipeline mesh has dims from {[PIPE, DATA, MODEL]} including {PIPE!r}, got {dims}")
    arr = np.asarray(mesh.mesh)
    for name in (PIPE, DATA, MODEL):
        if name not in dims:
            arr = arr[..., None]
            dims = dims + [name]
    arr = np.transpose(arr, [dims.index(n) for n in (PIPE, DATA, MODEL)])
    if list(arr.shape) != [pp, dp, tp]:
        raise ValueError(f"mesh shape (pipe, data, model) = {list(arr.shape)}, expected the degrees "
                         f"[pp, dp, tp] = {[pp, dp, tp]}")
    return arr


def _stage_meshes(ranks: np.ndarray) -> list:
    from autoparallel.mesh import ProcessMesh

    return [ProcessMesh(ranks[k].tolist(), [DATA, MODEL]) for k in range(ranks.shape[0])]


def _p2p_pairs(schedule, ranks: np.ndarray) -> list:
    """Global rank pairs that exchange messages: pipeline-rank pairs from the schedule's transfers, each
    for every (data, model) coordinate, in one fixed order."""
    pp_pairs = sorted({tuple(sorted((r, a.peer_rank))) for r, acts in enumerate(schedule) for a in acts
                       if a.is_comm})
    _, dp, tp = ranks.shape
    return [tuple(sorted((int(ranks[a, d, t]), int(ranks[b, d, t]))))
            for a, b in pp_pairs for d in range(dp) for t in range(tp)]


def _shard_stage(stage, mesh, tp_plan) -> None:
    import fnmatch

    from autoparallel.layer import shard_layer
    from autoparallel.parallel.tensor_parallel import apply_tp
    from autoparallel.parallel.ties import holders

    before = holders(stage)
    if tp_plan:
        names = [n for n, _ in stage.named_sublayers() if n]
        plan = {pat: style for pat, style in tp_plan.items() if any(fnmatch.fnmatchcase(n, pat) for n in names)}
        if plan:
            apply_tp(stage, mesh, plan, tp_dim=MODEL)
    shard_layer(stage, mesh)
    if getattr(stage.pieces, "generic", False):
        _repoint_model(stage.pieces.model, before)


def _repoint_model(model, before) -> None:
    """A stage of a model split at its blocks runs the model's own forward, which reads parameters through the
    model's layers: every model slot still holding a parameter the stage replaced (a bare parameter the stage
    registered on a container of its own, a tied alias such as ``lm_head.weight`` of a layer the stage does not
    hold) gets the replacement too. ``before`` (the stage's slots before sharding) keeps the originals alive."""
    from autoparallel.parallel.ties import holders

    new = {id(s.param): s.current() for s in before if s.current() is not s.param}
    for s in holders(model):
        if id(s.param) in new:
            s.layer._parameters[s.attr] = new[id(s.param)]


def _world_loss(reporter: bool):
    def sync(loss):
        import paddle.distributed as dist

        t = paddle.to_tensor([float(loss) if reporter else 0.0], dtype="float64")
        dist.all_reduce(t)
        return float(t.numpy()[0])
    return sync


def bind_optimizer(optimizer, pipe):
    """Restrict a paddle optimizer to the parameters of ``pipe``, a PipelineModule (the distributed
    replacements of the ones it was built over, matched by model name; other stages' parameters dropped) and
    wrap it with ``shard_optimizer``, whose ``step`` reduces data-parallel partial gradients first and clips
    by the global norm over every stage (grad_clip.py); under ``strategy.sharding`` (stage 1 / 2) a ZeRO optimizer
    per stage sub-mesh instead (zero.py); under ``strategy.amp`` wrapped again to unscale and skip overflowing
    steps on every stage at once (amp.py)."""
    from autoparallel.parallel.optimizer import ShardedOptimizer

    from .grad_clip import PipelineOptimizer, check_clip

    inner = optimizer._inner if isinstance(optimizer, ShardedOptimizer) else optimizer
    if not hasattr(inner, "_parameter_list"):
        raise TypeError(f"expected a paddle optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, ShardedOptimizer):         # ap.shard_optimizer's: reduces nothing from now on
        from autoparallel.parallel.accumulation import retire_wrapper

        retire_wrapper(optimizer)
    if getattr(inner, "_grad_clip", None) is not None:
        check_clip(inner._grad_clip)
    local = dict(pipe.named_parameters())
    local_ids = {id(p) for p in local.values()}
    names = getattr(pipe, "original_names", {})

    def pick(params):
        out = []
        for p in params:
            q = p if id(p) in local_ids else local.get(names.get(id(p)))
            if q is not None and all(q is not r for r in out):
                out.append(q)
        return out

    params = inner._parameter_list
    if params and isinstance(params[0], dict):
        for group in params:
            group["params"] = pick(group["params"])
        for group in getattr(inner, "_param_groups", None) or []:
            if isinstance(group, dict):
                group["params"] = pick(group["params"])
    else:
        inner._parameter_list = pick(params)
        if getattr(inner, "_param_groups", None) is not None and not isinstance((inner._param_groups or [{}])[0], dict):
            inner._param_groups = list(inner._parameter_list)
    kept = sum(1 for _ in pick(local.values()))
    found = len(inner._parameter_list) if not (params and isinstance(params[0], dict)) else \
        sum(len(g["params"]) for g in params)
    if found == 0 and kept:
        raise ValueError(f"the optimizer holds none of this rank's {kept} stage parameters; build it over "
                         f"model.parameters() or pipe.parameters()")
    if getattr(pipe, "zero", None) is not None:                      # strategy.sharding (zero.py)
        from .zero import PipelineZeroOptimizer

        every = _stage_meshes(pipe.ranks) if pipe.ranks is not None else ()
        opt = PipelineZeroOptimizer(inner, pipe, *pipe.zero, dim=DATA, all_meshes=every)
    else:
        opt = PipelineOptimizer(inner, pipe)
    opt.register_step_post_hook(lambda _opt: setattr(pipe, "steps_taken", getattr(pipe, "steps_taken", 0) + 1))
    if getattr(pipe, "loss_scaler", None) is not None:              # strategy.amp (amp.py)
        from .amp import PipelineAmpOptimizer

        return PipelineAmpOptimizer(opt, pipe)
    return opt
