"""parallelize: turn an ordinary paddle Layer and optimizer into a data / tensor / sequence parallel pair.

    model, opt = ap.parallelize(model, opt, strategy=s)            # default plans by layer names (tp_plans.py)
    model, opt = ap.parallelize(model, opt, strategy=s, tp_plan={"blocks.*.attn.qkv": ap.ColWiseParallel()})

It reads as a flat sequence of apply steps (torchtitan style), each a small function below:

    if auto_mode == "full": strategy = planner.auto.choose(...)   # traced model, profile, printed explanation
    degrees = validate(strategy, world size, model)      # ValueError before any process work
    check_supported(strategy)                            # NotImplementedError for knobs not built yet
    plan    = resolve_tp_plan(model, degrees.tp, tp_plan) # defaults by layer names, user entries win
    plan    = apply_sp(model, plan)                       # sequence-parallel flags + norms on sequence shards
    if pp > 1: return apply_pp(model, strategy, plan)    # stages on sub-meshes, schedules as action lists
    mesh    = build_mesh(degrees)                        # [data, model]; the model dim varies fastest
    apply_tp(model, mesh, plan); replicate_remaining(model, mesh)   # tied parameters stay one (parallel/ties.py)
    apply_ac(model, granularity, every_n)                 # recompute (full / selective)
    apply_amp(model, dtype, level)                        # autocast boundaries (emulated on CPU)
    shard_inputs(model, mesh)                             # batch dim of model inputs (positional and keyword)
    materialize(model)                                    # paddle.LazyGuard models: each rank draws its shards
                                                          # (ZeRO-3: its chunks, in apply_zero) in creation order
    opt     = wrap_optimizer(opt, model, accumulation steps)
    opt     = apply_zero(model, opt, mesh, stage, ...)    # ZeRO 1/2/3 (+offload, HSDP) over the data axis
    opt     = AmpOptimizer(opt, LossScaler)               # scaled loss, found_inf agreed by all ranks

Inputs: a plain tensor entering the model is the global batch (the same on every rank) and is sharded on
its batch dim over the data dims (``parallel_guard(dims)`` changes those dims); a DistTensor (for example
from ``autoparallel.data.DistributedDataLoader``) must already live on the model's mesh.

Gradient accumulation follows paddle's ``shard_optimizer``: run ``gradient_accumulation_steps`` forward /
backward passes, then call ``opt.step()`` once; the gradients are reduced over the data axis and divided
by that number. From the second step on, backward hooks of the final micro-step launch the fused
reductions bucket by bucket (parallel/reducer.py); the non-final micro-steps run no gradient reduction.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import types
import weakref

from autoparallel.dist_tensor import DistTensor, is_dist, shard_tensor
from autoparallel.layer import replicate_remaining
from autoparallel.local_mode import local_mode
from autoparallel.mesh import ProcessMesh
from autoparallel.parallel.optimizer import ShardedOptimizer
from autoparallel.parallel.tensor_parallel import (ColWiseParallel, RowWiseParallel, SequenceParallel,
                                                   VocabParallelEmbedding, apply_tp, match_plan, name_matches)
from autoparallel.parallel.ties import check_replaced, holders, repoint
from autoparallel.parallel.tp_plans import FAMILIES, GPT_PLAN, LLAMA_PLAN, default_plan, family, no_family_error
from autoparallel.placement import Replicate, Shard
from autoparallel.strategy import Strategy

DATA, MODEL = "data", "model"

# Default tensor-parallel plans by layer-name family (parallel/tp_plans.py); names kept for importers.
DEFAULT_PLANS = FAMILIES
_NOT_YET = "not yet supported by ap.parallelize"


# ---- the apply steps ------------------------------------------------------------------------------------
def parallelize(model, optimizer=None, strategy: Strategy | None = None, mesh: ProcessMesh | None = None,
                tp_plan: dict | None = None, seq_len: int | None = None, cluster=None, *, _deferred: bool = False):
    """Distribute ``model`` (in place) and wrap ``optimizer``; returns ``(model, optimizer)``.

    ``strategy.auto_mode == "full"``: the planner chooses the strategy first (planner/auto.py), pricing
    ``seq_len`` tokens per sample (default: the model config's) on ``cluster`` (a profile .json, spec string
    or ClusterSpec; default ``$AP_CLUSTER_PROFILE``, else a built-in profile of the backend).
    Every Strategy field is honoured (docs/entry_points.md); without an optimizer, the fields that act on
    it (sharding, accumulation, loss scaling, checkpoint) are refused. ``_deferred``: ap.DataParallel, whose
    ap.Optimizer finishes the build."""
    from autoparallel import entry_points as ep

    where = "ap.DataParallel" if _deferred else "ap.parallelize"
    check_model(model, where)
    check_tp_plan(tp_plan, where)
    strategy = Strategy() if strategy is None else strategy
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be an ap.Strategy, got {type(strategy).__name__}")
    if getattr(model, "_ap_mesh", None) is not None:
        raise ValueError(f"{type(model).__name__} is already parallelized on {model._ap_mesh}; build a fresh model "
                         f"to parallelize it again")
    entry = ep.DATA_PARALLEL if _deferred else ep.PARALLELIZE
    ep.reject_unsupported(strategy, entry)
    if strategy.auto_mode == "full":
        from autoparallel.planner.auto import parallelize_auto

        _world_size()                                       # a launched rank must have initialised first
        again = functools.partial(parallelize, _deferred=_deferred)
        return parallelize_auto(again, model, optimizer, strategy, mesh, tp_plan, seq_len, cluster)
    _reject_unused_keywords(strategy, tp_plan, seq_len, cluster)
    ep.apply_seed(strategy)
    check_optimizer_params(model, optimizer, "ap.parallelize")
    degrees = strategy.validate(world_size=_world_size(), model_info=model_info(model))
    check_supported(strategy, optimizer, degrees)
    from autoparallel.watchdog import start_default

    start_default()                    # a real job names a lost or frozen rank in seconds (AP_WATCHDOG=off: none)
    if optimizer is None and not _deferred:
        ep.reject_needing_optimizer(strategy, "ap.parallelize")
    plan = resolve_tp_plan(model, degrees.tp, tp_plan)
    if strategy.sequence_parallel.enable:
        plan = apply_sp(model, plan)
    lazy = _has_lazy(model)
    if degrees.pp > 1:
        if lazy:
            raise NotImplementedError(f"lazy initialisation (paddle.LazyGuard) together with pipeline parallelism "
                                      f"is {_NOT_YET}; build the model without LazyGuard")
        names = {p.name: p for p in model.parameters()}
        pipe, optimizer = _pipeline(model, optimizer, strategy, mesh, plan)
        pipe._ap_build = Build(strategy, None, names, False, pipe=pipe)
        _attach_run(pipe, optimizer, strategy)
        return pipe, optimizer
    mesh = build_mesh(degrees.dp, degrees.tp) if mesh is None else check_mesh(mesh, degrees.dp, degrees.tp)
    original = holders(model)
    apply_tp(model, mesh, plan, tp_dim=MODEL)
    replicate_remaining(model, mesh)
    replaced = _replacements(original, model)
    if strategy.recompute.enable:
        from autoparallel.parallel.recompute import apply_ac

        apply_ac(model, strategy.recompute.granularity, strategy.recompute.checkpoint_every_n_layers)
    if strategy.amp.enable:
        from autoparallel.parallel.amp import apply_amp

        apply_amp(model, strategy.amp.dtype, strategy.amp.level)
    ep.batch_hook(model, strategy, degrees)
    shard_inputs(model, mesh)
    zero3 = strategy.sharding.enable and strategy.sharding.stage == 3
    if lazy and not (zero3 and (optimizer is not None or _deferred)):   # ZeRO-3: each rank's chunk in apply_zero
        from autoparallel.lazy_init import materialize

        materialize(model)
        lazy = False
    by_path = {s.path: s.param for s in original}          # tied holders all name the one replacement
    by_name = {by_path[n].name: q for n, q in model.named_parameters() if n in by_path}
    build = model._ap_build = Build(strategy, mesh, by_name, lazy, model=model)
    _BUILT[:] = [r for r in _BUILT if r() is not None and r() is not model] + [weakref.ref(model)]
    if optimizer is not None:
        optimizer = build_optimizer(build, wrap_optimizer(optimizer, replaced, strategy.gradient_accumulation_steps))
    _attach(model, optimizer, strategy)
    return model, optimizer


def check_model(model, where: str) -> None:
    import paddle

    if not isinstance(model, paddle.nn.Layer):
        raise TypeError(f"{where} expects the model as a paddle.nn.Layer, got {type(model).__name__} {model!r:.80}")


def check_tp_plan(tp_plan, where: str) -> None:
    """None, or a dict {layer-name pattern (str): tensor-parallel style}; which layers match is checked later."""
    if tp_plan is None:
        return
    if not isinstance(tp_plan, dict):
        raise TypeError(f"{where}: tp_plan must be a dict from layer-name patterns to styles (e.g. "
                        f"{{'blocks.*.mlp.fc1': ap.ColWiseParallel()}}) or None, got {type(tp_plan).__name__} "
                        f"{tp_plan!r:.80}")
    from autoparallel.parallel.tensor_parallel import STYLES

    for pattern, style in tp_plan.items():
        if not isinstance(pattern, str):
            raise TypeError(f"{where}: tp_plan keys are layer-name patterns (str), got {type(pattern).__name__} "
                            f"{pattern!r:.80}")
        if not isinstance(style, STYLES):
            raise TypeError(f"{where}: tp_plan[{pattern!r}] must be one of {[c.__name__ for c in STYLES]}, got "
                            f"{type(style).__name__} {style!r:.80}")


def _attach(model, optimizer, strategy) -> None:
    """The current run (resume, offload fallback, monitor) and strategy.checkpoint's post-step saves."""
    from autoparallel.auto_checkpoint import attach

    attach(model, optimizer, strategy)


@dataclasses.dataclass
class Build:
    """What ``parallelize`` / ``ap.DataParallel`` did to a model, for the optimizer side of the same build
    (``ap.Optimizer`` finds it on the model its optimizer's parameters belong to)."""
    strategy: Strategy
    mesh: ProcessMesh | None
    by_name: dict                      # original parameter name -> the model's (distributed) parameter
    lazy: bool                         # parameters still lazy: ZeRO-3 draws each rank's chunks itself
    model: object = None
    pipe: object = None                # pp > 1: the PipelineModule
    optimizer: object = None           # the wrapper the build returned, once built


def build_optimizer(build: Build, optimizer):
    """The optimizer side of a build: ZeRO 1-3 (+offload, HSDP), AMP loss scaling; ``optimizer`` is the
    AccumulatingOptimizer over the model's distributed parameters."""
    strategy, model, mesh = build.strategy, build.model, build.mesh
    if strategy.amp.enable:             # AMP unscales p.grad before the step: no reduction still in flight
        optimizer.grad_sync.async_op = False
    if strategy.sharding.enable:
        if build.lazy and strategy.sharding.stage == 3:
            from autoparallel.lazy_init import apply_zero_lazy as apply_zero
        else:
            from autoparallel.parallel.sharding import apply_zero

        optimizer = apply_zero(model, optimizer, mesh, strategy.sharding.stage, dp_dim=DATA,
                               degree=strategy.sharding.degree or None, offload=strategy.sharding.offload,
                               gradient_accumulation_steps=strategy.gradient_accumulation_steps)
        optimizer.overlap = not strategy.amp.enable      # AMP unscales p.grad; stage 2/3 chunks are not there
        build.lazy = False
    if strategy.amp.enable:
        from autoparallel.parallel.amp import AmpOptimizer, LossScaler

        optimizer = AmpOptimizer(optimizer, LossScaler.from_strategy(strategy.amp), mesh)
    build.optimizer = optimizer
    _attach_run(model, optimizer, strategy)
    return optimizer


def _attach_run(model, optimizer, strategy) -> None:
    """The current run (resume, offload fallback, monitor) and strategy.checkpoint's post-step saves."""
    from autoparallel.auto_checkpoint import attach

    attach(model, optimizer, strategy)


def _reject_unused_keywords(strategy, tp_plan, seq_len, cluster) -> None:
    """Keywords of ap.parallelize that this strategy would not use."""
    unused = [f"{n}={v!r}" for n, v in (("seq_len", seq_len), ("cluster", cluster)) if v is not None]
    if unused:
        raise ValueError(f"ap.parallelize: {', '.join(unused)} price the planner's choice and are used only with "
                         f"strategy.auto_mode='full' (got auto_mode={strategy.auto_mode!r})")
    if tp_plan and strategy.tensor_parallel.degree == 1:
        raise ValueError(f"ap.parallelize: tp_plan={{{', '.join(map(repr, tp_plan))}}} shards layers over the tensor-"
                         f"parallel group, but strategy.tensor_parallel.degree=1; set the degree > 1 or drop tp_plan")


def _has_lazy(model) -> bool:
    """Parameters created under ``paddle.LazyGuard`` are laid out first and allocated shard by shard."""
    from autoparallel.lazy_init import has_lazy

    return has_lazy(model)


def _pipeline(model, optimizer, strategy, mesh, plan):
    """pp > 1: stages on their own sub-meshes (TP/SP/DP inside), run by the pipeline runtime; train with
    ``loss = pipe.train_batch(ids, labels); opt.step()``."""
    from autoparallel.parallel.pipeline.runtime import apply_pp

    pipe = apply_pp(model, strategy, mesh=mesh, tp_plan=plan or None)
    return pipe, (pipe.wrap_optimizer(optimizer) if optimizer is not None else None)


def _world_size() -> int:
    from autoparallel.comm.world import current_world

    world = current_world()
    if not world.is_simulated and not getattr(world, "initialized", True):
        launched = int(os.environ.get("PADDLE_TRAINERS_NUM", "1") or 1)
        if launched > 1:
            raise RuntimeError(f"this process is one of {launched} launched ranks but paddle.distributed is not "
                               f"initialised; call paddle.distributed.init_parallel_env() before ap.parallelize")
    return world.world_size


def model_info(model) -> dict:
    """Heads / kv_heads / hidden / layers / vocab from ``model.config`` when it has them (for validation).
    PaddleFormers / Hugging Face names count too, except their kv heads: fewer kv heads than TP ranks is
    handled by the default plan (k/v projections replicated, parallel/tp_plans.py), not refused."""
    c = getattr(model, "config", None)
    keys = {"heads": ("heads", "num_attention_heads"), "kv_heads": ("kv_heads",),
            "hidden": ("hidden", "hidden_size"), "layers": ("layers", "num_hidden_layers"), "vocab": ("vocab_size",)}
    out = {}
    for key, attrs in keys.items():
        for attr in attrs:
            v = getattr(c, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                out[key] = v
                break
    return out


def check_supported(strategy: Strategy, optimizer=None, degrees=None) -> None:
    """Strategy knobs this release does not execute yet fail loudly instead of being ignored."""
    import paddle

    s = strategy
    inner = getattr(optimizer, "_inner", optimizer)
    clip = getattr(inner, "_grad_clip", None)
    if degrees is not None and degrees.tp > 1 and isinstance(clip, paddle.nn.ClipGradByNorm):
        raise NotImplementedError(f"per-parameter norm clipping (ClipGradByNorm) across tensor-parallel shards is "
                                  f"{_NOT_YET} (each rank would clip its shard by the shard's norm); use "
                                  f"ClipGradByGlobalNorm or ClipGradByValue")
    pp = s.pipeline_parallel.degree > 1
    knobs = [(pp and s.sharding.enable, "sharding (ZeRO) together with pipeline parallelism"),
             (pp and s.recompute.enable, "recompute together with pipeline parallelism"),
             (pp and s.amp.enable, "amp together with pipeline parallelism")]
    for on, what in knobs:
        if on:
            raise NotImplementedError(f"{what} is {_NOT_YET}")


def build_mesh(dp: int, tp: int) -> ProcessMesh:
    """Ranks 0..dp*tp-1 as a [data, model] mesh, model fastest-varying: a TP group is tp consecutive ranks,
    which ``paddle.distributed.launch`` places on one node; data-parallel groups span the nodes."""
    return ProcessMesh([[d * tp + t for t in range(tp)] for d in range(dp)], dim_names=[DATA, MODEL])


def check_mesh(mesh, dp: int, tp: int) -> ProcessMesh:
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"mesh must be an ap.ProcessMesh, got {type(mesh).__name__}")
    if mesh.dim_names != [DATA, MODEL] or mesh.shape != [dp, tp]:
        raise ValueError(f"mesh must have dims ['data', 'model'] and shape [dp, tp] = [{dp}, {tp}] for this "
                         f"strategy, got dims {mesh.dim_names} and shape {mesh.shape}")
    return mesh


def resolve_tp_plan(model, tp: int, user_plan: dict | None = None) -> dict:
    """{exact layer name: style}: the default plan for the layer names the model has (suffix patterns, any
    depth; parallel/tp_plans.py), overridden by the user's entries."""
    if tp == 1:
        return {}
    user = {name: style for name, _, style in match_plan(model, user_plan)} if user_plan is not None else {}
    resolved = default_plan(model, tp)
    if not resolved and not user:
        raise no_family_error(model, tp)
    resolved.update(user)
    return resolved


def apply_sp(model, plan: dict) -> dict:
    """Sequence parallel: row-parallel and vocab-parallel outputs become sequence shards (reduce_scatter
    instead of all_reduce) and every norm layer runs on sequence shards."""
    out = {}
    for name, style in plan.items():
        if isinstance(style, (RowWiseParallel, VocabParallelEmbedding)):
            style = dataclasses.replace(style, sequence_parallel=True)
        out[name] = style
    if not out:
        return out
    for name, layer in model.named_sublayers():
        if name and name not in out and type(layer).__name__.endswith("Norm"):
            out[name] = SequenceParallel()
    return out


def _replacements(before: list, model) -> dict:
    """{id(original parameter): its distributed replacement}: every holder of a tied parameter repointed to
    the one replacement, then checked that no original parameter is reachable from the model."""
    replaced = repoint(model, before)
    check_replaced(model, before)
    return replaced


# ---- model inputs ----------------------------------------------------------------------------------------
from autoparallel.context import state as _ctx  # noqa: E402


def parallel_guard(dims=(DATA,)):
    """Inside, plain tensors entering a parallelized model are sharded on their batch dim over the mesh dims
    named in ``dims`` and replicated over the others (``parallel_guard([])`` replicates them). The names are
    those of ``ap.parallelize``'s mesh: ``'data'`` and ``'model'``."""
    if isinstance(dims, str) or not isinstance(dims, (list, tuple)) or not all(isinstance(d, str) for d in dims):
        raise TypeError(f"parallel_guard expects a list of mesh dim names (of {[DATA, MODEL]}), got "
                        f"{type(dims).__name__} {dims!r:.80}")
    unknown = [d for d in dims if d not in (DATA, MODEL)]
    if unknown:
        raise ValueError(f"parallel_guard: unknown mesh dim names {unknown}; ap.parallelize's mesh has dims "
                         f"{[DATA, MODEL]}, got dims={list(dims)}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"parallel_guard: each mesh dim may be named once, got dims={list(dims)}")
    return _guarded(list(dims))


@contextlib.contextmanager
def _guarded(dims: list):
    stack = _ctx.guard_stack
    if stack is None:
        stack = _ctx.guard_stack = []
    stack.append(dims)
    try:
        yield
    finally:
        stack.pop()


def _input_dims():
    stack = _ctx.guard_stack
    return stack[-1] if stack else [DATA]


def shard_inputs(model, mesh) -> None:
    """A forward pre-hook distributing the model's tensor inputs, positional and keyword alike (see the module
    docstring)."""
    import paddle

    def place(x):
        if isinstance(x, DistTensor):
            if x.mesh != mesh:
                raise ValueError(f"{type(model).__name__} runs on mesh {mesh} but got a DistTensor on mesh "
                                 f"{x.mesh}; reshard it onto the model's mesh (ap.reshard) or pass the plain tensor")
            return x
        if not isinstance(x, (paddle.Tensor, paddle.pir.Value)) or x.ndim == 0:      # Value: jit.to_static
            return x
        dims = _input_dims()
        unknown = [d for d in dims if d not in mesh.dim_names]
        if unknown:
            raise ValueError(f"parallel_guard names mesh dims {unknown}; the model's mesh has {mesh.dim_names}")
        placements = [Shard(0) if n in dims else Replicate() for n in mesh.dim_names]
        return shard_tensor(x, mesh, placements)

    def pre(_layer, args, kwargs):                 # keyword inputs (model(input_ids=..., labels=...)) too
        return tuple(place(x) for x in args), {k: place(v) for k, v in kwargs.items()}

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model._ap_mesh = mesh


# ---- optimizer ---------------------------------------------------------------------------------------------
class AccumulatingOptimizer(ShardedOptimizer):
    """``shard_optimizer`` semantics for gradient accumulation (paddle's): ``step()`` runs once per
    ``gradient_accumulation_steps`` backward passes; the gradients, reduced over the data axis in buckets
    (by the final micro-step's backward hooks, the rest at the step), are divided by that number and the
    local shards updated."""

    @property
    def parameters(self):
        return list(_flat_params(self._inner))

    def _scale_gradients(self):
        k = self.gradient_accumulation_steps
        if k > 1:
            with local_mode():
                for p in self.parameters:
                    for t in (p.locals.values() if is_dist(p) else [p]):
                        if t.grad is not None:
                            t.grad.set_value(t.grad * (1.0 / k))


def wrap_optimizer(optimizer, replaced: dict, gradient_accumulation_steps: int = 1) -> AccumulatingOptimizer:
    """Point the optimizer at the distributed parameters and wrap it (idempotent on a wrapped one)."""
    if isinstance(optimizer, ShardedOptimizer):
        optimizer = optimizer._inner
    if not hasattr(optimizer, "_parameter_list"):
        raise TypeError(f"expected a paddle optimizer, got {type(optimizer).__name__}")
    if not optimizer._parameter_list:
        raise ValueError("the optimizer has no parameters; build it with parameters=model.parameters()")
    _rebind(optimizer, replaced)
    return AccumulatingOptimizer(optimizer, gradient_accumulation_steps=gradient_accumulation_steps, overlap=True)


def _rebind(optimizer, replaced: dict) -> None:
    params = optimizer._parameter_list
    if params and isinstance(params[0], dict):           # parameter groups
        for group in params:
            group["params"] = [replaced.get(id(p), p) for p in group["params"]]
        for group in getattr(optimizer, "_param_groups", []) or []:
            if isinstance(group, dict):
                group["params"] = [replaced.get(id(p), p) for p in group["params"]]
        return
    optimizer._parameter_list = [replaced.get(id(p), p) for p in params]
    groups = getattr(optimizer, "_param_groups", None)
    if groups is not None and groups and not isinstance(groups[0], dict):
        optimizer._param_groups = list(optimizer._parameter_list)


# ---- seed-style wrappers -------------------------------------------------------------------------------------
_BUILT: list = []      # weak references to models built by ap.parallelize / ap.DataParallel (ap.Optimizer finds them)


def DataParallel(model, strategy: Strategy | None = None, tp_plan: dict | None = None):
    """Seed-style: ``dp_model = ap.DataParallel(model, strategy=s)`` + ``opt = ap.Optimizer(opt)``: the same
    build as ``ap.parallelize(model, opt, strategy=s)``, in two calls. This one does the model side (TP/SP
    plans, recompute, AMP casts, input sharding; the pipeline for pp > 1) and records the strategy on the
    model; ``ap.Optimizer`` finds it from the optimizer's parameters and finishes the build (ZeRO 1-3 and
    offload, AMP loss scaling, gradient accumulation, clipping). Unlike ``paddle.DataParallel``, a plain
    tensor fed to the model is the global batch (the same on every rank); feed per-rank batches as
    DistTensors, e.g. from ``autoparallel.data.DistributedDataLoader``."""
    check_model(model, "ap.DataParallel")
    check_tp_plan(tp_plan, "ap.DataParallel")
    strategy = Strategy() if strategy is None else strategy
    if not isinstance(strategy, Strategy):
        raise TypeError(f"ap.DataParallel: strategy must be an ap.Strategy, got {type(strategy).__name__}")
    out, _ = parallelize(model, None, strategy, tp_plan=tp_plan, _deferred=True)
    _BUILT[:] = [r for r in _BUILT if r() is not None] + [weakref.ref(out)]
    _attach_run(out, None, strategy)
    return out


def _find_build(params):
    """(build, {id(plain parameter): its distributed replacement}) of the model ``params`` belong to."""
    for ref in reversed(_BUILT):
        model = ref()
        build = getattr(model, "_ap_build", None)
        if build is None:
            continue
        own = {id(p) for p in model.parameters()}
        if build.pipe is not None:
            if any(id(p) in own or p.name in build.by_name for p in params):
                return build, {id(p): p for p in params if p.name in build.by_name}
            continue
        replaced = {id(p): build.by_name[p.name] for p in params if id(p) not in own and p.name in build.by_name}
        if any(id(p) in own for p in params) or replaced:
            return build, replaced
    return None, {}


def model_of_params(params):
    """The model built by ap.parallelize / ap.DataParallel whose parameters ``params`` are (None if none)."""
    ids = {id(p) for p in params}
    for ref in reversed(_BUILT):
        model = ref()
        if model is not None and ids & {id(p) for p in model.parameters()}:
            return model
    return None


def Optimizer(optimizer, strategy: Strategy | None = None):
    """Seed-style: ``opt = ap.Optimizer(opt)`` over a model wrapped by ``ap.DataParallel`` (see there); an
    optimizer built before the wrapping is pointed at the distributed parameters (matched by name). Without
    a DataParallel model it wraps an optimizer over already-distributed parameters like ``shard_optimizer``,
    and refuses strategy options that need the model (naming them)."""
    inner = optimizer._inner if isinstance(optimizer, ShardedOptimizer) else optimizer
    if not hasattr(inner, "_parameter_list"):
        raise TypeError(f"ap.Optimizer expects a paddle optimizer, got {type(optimizer).__name__}")
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"ap.Optimizer: strategy must be an ap.Strategy, got {type(strategy).__name__}")
    params = list(_flat_params(inner))
    build, replaced = _find_build(params)
    if build is None:
        from autoparallel.entry_points import reject_without_model

        s = Strategy() if strategy is None else strategy
        reject_without_model(s)
        if not any(is_dist(p) for p in params):
            raise ValueError(f"ap.Optimizer: none of the optimizer's {len(params)} parameters belongs to a model "
                             f"built by ap.DataParallel or is distributed (ap.shard_layer / ap.shard_tensor); call "
                             f"ap.DataParallel(model, strategy=s) before ap.Optimizer(optimizer)")
        return wrap_optimizer(inner, {}, s.gradient_accumulation_steps)
    if strategy is not None and strategy.to_dict() != build.strategy.to_dict() and build.strategy is not strategy:
        raise ValueError(f"ap.Optimizer(strategy=...) differs from the strategy ap.DataParallel built the model "
                         f"with ({build.strategy}); pass the same strategy or none")
    if build.optimizer is not None and build.strategy.sharding.enable:
        raise ValueError("ap.Optimizer: this model's ZeRO sharding is already built with an optimizer; build a "
                         "fresh model (ap.DataParallel) for a second one")
    model = build.pipe if build.pipe is not None else build.model
    check_optimizer_params(model, inner, "ap.Optimizer", replaced)
    check_supported(build.strategy, inner, build.strategy.validate(world_size=_world_size()))
    if build.pipe is not None:
        build.optimizer = build.pipe.wrap_optimizer(inner)
        _attach_run(build.pipe, build.optimizer, build.strategy)
        return build.optimizer
    k = build.strategy.gradient_accumulation_steps
    return build_optimizer(build, wrap_optimizer(inner, replaced, k))


def check_optimizer_params(model, optimizer, where: str, replaced: dict | None = None) -> None:
    """The optimizer must update the model's parameters (all or some): name how many are foreign."""
    if optimizer is None:
        return
    inner = optimizer._inner if isinstance(optimizer, ShardedOptimizer) else optimizer
    if not hasattr(inner, "_parameter_list"):
        return                                              # wrap_optimizer names the type error
    own = {id(p) for p in model.parameters()} | set(replaced or {})
    params = list(_flat_params(inner))
    foreign = [p for p in params if id(p) not in own]
    if foreign:
        names = ", ".join(p.name for p in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(f"{where}: {len(foreign)} of the optimizer's {len(params)} parameters are not "
                         f"parameters of the {type(model).__name__} ({names}); build the optimizer with "
                         f"parameters=model.parameters() of this model")


def _flat_params(optimizer):
    for p in optimizer._parameter_list or []:
        if isinstance(p, dict):
            yield from p["params"]
        else:
            yield p


def _matches(model, pattern: str) -> bool:
    return any(name_matches(n, pattern) for n, _ in model.named_sublayers() if n)


def _default_family(model):
    return family(model)


__all__ = ["parallelize", "DataParallel", "Optimizer", "parallel_guard", "build_mesh", "resolve_tp_plan",
           "apply_sp", "check_supported", "AccumulatingOptimizer", "GPT_PLAN", "LLAMA_PLAN"]


class _CallableModule(types.ModuleType):
    """``autoparallel`` exports the function ``parallelize`` lazily, but importing this submodule first
    (``from autoparallel.parallelize import parallel_guard``) binds ``autoparallel.parallelize`` to the
    module; calling the module therefore calls the function, so ``ap.parallelize(...)`` always works."""

    def __call__(self, *args, **kwargs):
        return parallelize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
