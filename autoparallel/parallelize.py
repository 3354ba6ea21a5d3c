"""parallelize: turn an ordinary paddle Layer and optimizer into a data / tensor / sequence parallel pair.

    model, opt = ap.parallelize(model, opt, strategy=s)            # default plans by layer names (tp_plans.py)
    model, opt = ap.parallelize(model, opt, strategy=s, tp_plan={"blocks.*.attn.qkv": ap.ColWiseParallel()})

It reads as a flat sequence of apply steps (torchtitan style), each a small function below:

    if auto_mode == "full": strategy = planner.auto.plan_strategy(...)   # the planner returns a Strategy
    degrees = validate(strategy, world size, model)      # ValueError before any process work
    check_supported(strategy)                            # NotImplementedError for knobs not built yet
    styles  = resolve_tp_plan(model, degrees.tp, tp_plan) # defaults by layer names, user entries win
    styles  = apply_sp(model, styles)                     # sequence-parallel flags + norms on sequence shards
    if pp > 1: return apply_pp(model, strategy, styles)  # stages on sub-meshes, schedules as action lists
    mesh    = build_mesh(degrees)                        # [data, model]; the model dim varies fastest
    apply_tp(model, mesh, styles); replicate_remaining(model, mesh)   # tied parameters stay one (parallel/ties.py)
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

Gradient accumulation is paddle's ``gradient_merge`` with ``avg=True``: run ``gradient_accumulation_steps``
forward / backward passes with the loss as it is, then call ``opt.step()`` once; the gradients are reduced over
the data axis and divided by that number in the step (unlike ``ap.shard_optimizer(...,
gradient_accumulation_steps=k)``, whose loop divides its loss). From the second step on, backward hooks of the
final micro-step launch the fused reductions bucket by bucket (parallel/reducer.py); the non-final micro-steps
run no gradient reduction.
"""
from __future__ import annotations

import os
import weakref

from autoparallel import layer_state
from autoparallel.api_strategy import as_strategy
from autoparallel.dist_tensor import is_dist
from autoparallel.layer import replicate_remaining
from autoparallel.mesh import ProcessMesh
from autoparallel.parallel.accumulation import (AccumulatingOptimizer, check_optimizer_params,  # noqa: F401
                                                flat_params, wrap_optimizer)
from autoparallel.parallel.builds import BUILT, Build, find_build, model_of_params  # noqa: F401
from autoparallel.parallel.input_sharding import parallel_guard, shard_inputs  # noqa: F401
from autoparallel.parallel.mesh_dims import DATA, MODEL, build_mesh, check_mesh  # noqa: F401
from autoparallel.parallel.model_families import DEFAULT_PLANS, apply_sp, model_info, resolve_tp_plan  # noqa: F401
from autoparallel.parallel.model_families import check_built_split, check_declared_degrees
from autoparallel.parallel.optimizer import ShardedOptimizer
from autoparallel.parallel.tensor_parallel import apply_tp
from autoparallel.parallel.ties import check_replaced, holders, repoint
from autoparallel.parallel.tp_plans import GPT_PLAN, LLAMA_PLAN  # noqa: F401
from autoparallel.strategy import Strategy

_NOT_YET = "not yet supported by ap.parallelize"


# ---- the apply steps ------------------------------------------------------------------------------------
def parallelize(model, optimizer=None, strategy: Strategy | None = None, mesh: ProcessMesh | None = None,
                tp_plan: dict | None = None, seq_len: int | None = None, cluster=None, *, config: dict | None = None,
                _deferred: bool = False):
    """Distribute ``model`` (in place) and wrap ``optimizer``; returns ``(model, optimizer)``.

    ``strategy.auto_mode == "full"``: the planner chooses the strategy first (planner/auto.py), pricing
    ``seq_len`` tokens per sample (default: the model config's) on ``cluster`` (a profile .json, spec string
    or ClusterSpec; default ``$AP_CLUSTER_PROFILE``, else a built-in profile of the backend).
    Every Strategy field is honoured (docs/entry_points.md); without an optimizer, the fields that act on
    it (sharding, accumulation, loss scaling, checkpoint) are refused. ``_deferred``: ap.DataParallel, whose
    ap.Optimizer finishes the build. paddle's form ``parallelize(model, optimizer, mesh, config)`` is translated
    first (api_parallelize.py)."""
    from autoparallel import entry_points as ep
    from autoparallel.api_parallelize import paddle_form

    strategy, mesh, tp_plan, prepares = paddle_form(model, strategy, mesh, config, tp_plan)
    if prepares:                                        # PrepareLayerInput/Output: hooks after the build
        from autoparallel.api_prepare import apply_prepares

        model, optimizer = parallelize(model, optimizer, strategy, mesh, tp_plan, seq_len, cluster, _deferred=_deferred)
        apply_prepares(model, prepares)
        return model, optimizer

    where = "ap.DataParallel" if _deferred else "ap.parallelize"
    check_model(model, where)
    check_built_split(model, where)
    check_tp_plan(tp_plan, where)
    strategy = Strategy() if strategy is None else strategy
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be an ap.Strategy, got {type(strategy).__name__}")
    if layer_state.mesh_of(model) is not None:
        raise ValueError(f"{type(model).__name__} is already parallelized on {layer_state.mesh_of(model)}; build a fresh model "
                         f"to parallelize it again")
    entry = ep.DATA_PARALLEL if _deferred else ep.PARALLELIZE
    ep.reject_unsupported(strategy, entry)
    if strategy.auto_mode == "full":
        from autoparallel.planner.auto import plan_strategy

        _world_size()                                       # a launched rank must have initialised first
        chosen, result = plan_strategy(model, strategy, seq_len, cluster, mesh, tp_plan)  # returns a Strategy
        model, optimizer = parallelize(model, optimizer, chosen, mesh, tp_plan, _deferred=_deferred)
        layer_state.put(model, "strategy", chosen)
        layer_state.put(model, "plan", result)
        return model, optimizer
    _reject_unused_keywords(strategy, tp_plan, seq_len, cluster)
    ep.apply_seed(strategy)
    check_optimizer_params(model, optimizer, "ap.parallelize")
    degrees = strategy.validate(world_size=_world_size(), model_info=model_info(model))
    check_supported(strategy, optimizer, degrees)
    check_declared_degrees(model, strategy, degrees)
    from autoparallel.watchdog import start_default

    start_default()                    # a real job names a lost or frozen rank in seconds (AP_WATCHDOG=off: none)
    if optimizer is None and not _deferred:
        ep.reject_needing_optimizer(strategy, "ap.parallelize")
    styles = resolve_tp_plan(model, degrees.tp, tp_plan)      # {exact layer name: style}
    if strategy.sequence_parallel.enable:
        styles = apply_sp(model, styles)
    lazy = _has_lazy(model)
    if degrees.pp > 1:
        if lazy:
            raise NotImplementedError(f"lazy initialisation (paddle.LazyGuard) together with pipeline parallelism "
                                      f"is {_NOT_YET}; build the model without LazyGuard")
        names = {p.name: p for p in model.parameters()}
        pipe, optimizer = _pipeline(model, optimizer, strategy, mesh, styles)
        layer_state.put(pipe, "build", Build(strategy, None, names, False, pipe=pipe))
        _attach_run(pipe, optimizer, strategy)
        return pipe, optimizer
    mesh = build_mesh(degrees.dp, degrees.tp) if mesh is None else check_mesh(mesh, degrees.dp, degrees.tp)
    original = holders(model)
    apply_tp(model, mesh, styles, tp_dim=MODEL)
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
    build = Build(strategy, mesh, by_name, lazy, model=model)
    layer_state.put(model, "build", build)
    BUILT[:] = [r for r in BUILT if r() is not None and r() is not model] + [weakref.ref(model)]
    if optimizer is not None:
        optimizer = build_optimizer(build, wrap_optimizer(optimizer, replaced, strategy.gradient_accumulation_steps,
                                                            "ap.parallelize"))
    if not _deferred:                  # another optimizer over this model's parameters (a GAN's second one)
        from autoparallel.parallel.stale_optimizers import repoint_optimizers

        within = {id(s.param) for s in original} | {id(p) for p in model.parameters()}
        repoint_optimizers(replaced, stepped="skip", within=within)
    _attach_run(model, optimizer, strategy)
    return model, optimizer


def check_model(model, where: str) -> None:
    import paddle

    if isinstance(model, (list, tuple)) and all(isinstance(m, paddle.nn.Layer) for m in model):
        raise TypeError(f"{where} takes one model, got a {type(model).__name__} of {len(model)}: parallelize each "
                        f"model with its own call (a second optimizer is repointed to the distributed parameters), "
                        f"or hold them in one paddle.nn.Layer (docs/several_models.md)")
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


def _pipeline(model, optimizer, strategy, mesh, styles):
    """pp > 1: stages on their own sub-meshes (TP/SP/DP inside), run by the pipeline runtime; train with
    ``loss = pipe.train_batch(ids, labels); opt.step()``, or the one-process loop ``loss = pipe(ids, labels=labels);
    loss.backward(); opt.step()`` (parallel/pipeline/called.py)."""
    from autoparallel.parallel.pipeline.runtime import apply_pp

    from autoparallel import hapi_forms, trainer_forms

    pipe = apply_pp(model, strategy, mesh=mesh, tp_plan=styles or None)
    trainer_forms.install()             # the Trainer and hapi over a pipeline (trainer_pipeline.py, hapi_forms.py),
    hapi_forms.install()                # also where no distributed tensor installs dispatch (pp without dp / tp)
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


def check_supported(strategy: Strategy, optimizer=None, degrees=None) -> None:
    """Strategy knobs this release does not execute yet fail loudly instead of being ignored."""
    knobs = []                          # ZeRO with pipelines: stages 1-2 run, 3 refused (parallel/pipeline/wiring.py)
    for on, what in knobs:
        if on:
            raise NotImplementedError(f"{what} is {_NOT_YET}")


def _replacements(before: list, model) -> dict:
    """{id(original parameter): its distributed replacement}: every holder of a tied parameter repointed to
    the one replacement, then checked that no original parameter is reachable from the model."""
    replaced = repoint(model, before)
    check_replaced(model, before)
    from autoparallel.parallel.cross_ties import join

    return join(model, before, replaced)            # a parameter shared with a model parallelized earlier


# ---- seed-style wrappers ------------------------------------------------------------------------------------
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
    strategy = Strategy() if strategy is None else as_strategy(strategy)
    if not isinstance(strategy, Strategy):
        raise TypeError(f"ap.DataParallel: strategy must be an ap.Strategy, got {type(strategy).__name__}")
    out, _ = parallelize(model, None, strategy, tp_plan=tp_plan, _deferred=True)
    BUILT[:] = [r for r in BUILT if r() is not None] + [weakref.ref(out)]
    _attach_run(out, None, strategy)
    return out


def Optimizer(optimizer, strategy: Strategy | None = None):
    """Seed-style: ``opt = ap.Optimizer(opt)`` over a model wrapped by ``ap.DataParallel`` (see there); an
    optimizer built before the wrapping is pointed at the distributed parameters (matched by name). Without
    a DataParallel model it wraps an optimizer over already-distributed parameters like ``shard_optimizer``,
    and refuses strategy options that need the model (naming them)."""
    inner = optimizer._inner if isinstance(optimizer, ShardedOptimizer) else optimizer
    if not hasattr(inner, "_parameter_list"):
        raise TypeError(f"ap.Optimizer expects a paddle optimizer, got {type(optimizer).__name__}")
    strategy = as_strategy(strategy)
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"ap.Optimizer: strategy must be an ap.Strategy, got {type(strategy).__name__}")
    params = list(flat_params(inner))
    build, replaced = find_build(params)
    if build is None:
        from autoparallel.entry_points import apply_seed, reject_without_model

        s = Strategy() if strategy is None else strategy
        reject_without_model(s)
        if not any(is_dist(p) for p in params):
            raise ValueError(f"ap.Optimizer: none of the optimizer's {len(params)} parameters belongs to a model "
                             f"built by ap.DataParallel or is distributed (ap.shard_layer / ap.shard_tensor); call "
                             f"ap.DataParallel(model, strategy=s) before ap.Optimizer(optimizer)")
        wrapped = wrap_optimizer(optimizer, {}, s.gradient_accumulation_steps, "ap.Optimizer")
        apply_seed(s)                                   # the other option it accepts here
        return wrapped
    if strategy is not None and strategy.to_dict() != build.strategy.to_dict() and build.strategy is not strategy:
        raise ValueError(f"ap.Optimizer(strategy=...) differs from the strategy ap.DataParallel built the model "
                         f"with ({build.strategy}); pass the same strategy or none")
    if build.optimizer_built and build.strategy.sharding.enable:
        raise ValueError("ap.Optimizer: this model's ZeRO sharding is already built with an optimizer; build a "
                         "fresh model (ap.DataParallel) for a second one")
    model = build.pipe if build.pipe is not None else build.model
    check_optimizer_params(model, inner, "ap.Optimizer", replaced)
    check_supported(build.strategy, inner, build.strategy.validate(world_size=_world_size()))
    if build.pipe is not None:
        build.optimizer = build.pipe.wrap_optimizer(optimizer)       # a held wrapper is retired there
        _attach_run(build.pipe, build.optimizer, build.strategy)
        return build.optimizer
    k = build.strategy.gradient_accumulation_steps
    return build_optimizer(build, wrap_optimizer(optimizer, replaced, k, "ap.Optimizer"))


# Names marked noqa: F401 above live in autoparallel.parallel.* and stay importable from this module.
__all__ = ["parallelize", "DataParallel", "Optimizer", "parallel_guard", "build_mesh", "resolve_tp_plan",
           "apply_sp", "check_supported", "AccumulatingOptimizer", "GPT_PLAN", "LLAMA_PLAN"]
