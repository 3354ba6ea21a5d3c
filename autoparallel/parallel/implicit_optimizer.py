"""A plain paddle optimizer over distributed parameters behaves as ``ap.shard_optimizer(opt)``.

Paddle lets a user step an optimizer built over the parameters of a layer distributed with
``shard_layer`` without wrapping it. Here a distributed parameter's gradient lives on its local shards
(and, for a data-parallel layout, is still a partial sum), so paddle's own ``step`` would find no
gradient and update nothing: the model would silently not train. While dispatch is installed,
``step`` / ``clear_grad`` of a paddle optimizer holding a distributed parameter therefore run through
a ``ShardedOptimizer`` kept for that optimizer (gradients reduced at ``step``, no backward overlap, so
any number of ``backward()`` calls before a step accumulate as paddle's do); ``minimize`` is the wrapper's (a step).
An ap wrapper calls the inner optimizer in local mode, where the original methods run unchanged.
"""
from __future__ import annotations

from autoparallel.compat import SideData
from autoparallel.context import state as _ctx
from autoparallel.dist_tensor import is_dist
from autoparallel.parallel.param_list import flat_params

_WRAPPERS = SideData()          # paddle optimizer -> its ShardedOptimizer


def needs_wrapper(opt) -> bool:
    """A paddle optimizer, called outside an ap wrapper, that holds a distributed parameter."""
    return _ctx.local_depth == 0 and any(is_dist(p) for p in flat_params(opt))


def wrapper_for(opt):
    w = _WRAPPERS.get(opt)
    if w is None:
        from autoparallel.parallel.optimizer import ShardedOptimizer

        _check_not_zero(opt)
        _check_build_finished(opt)
        w = ShardedOptimizer(opt, None, 1, overlap=False)
        _WRAPPERS.set(opt, w)
    return w


def _check_not_zero(opt) -> None:
    """A second, plain optimizer over parameters a ZeRO optimizer manages would step them without the sharding
    the strategy asked for (stage 3: over released parameters): refused, naming the optimizer to step."""
    from autoparallel.dist_tensor_forms import ZERO_OWNERS

    owned = [p.name for p in flat_params(opt) if ZERO_OWNERS.get(p) is not None and ZERO_OWNERS.get(p)() is not None]
    if owned:
        raise NotImplementedError(
            f"{type(opt).__name__}.step over {len(owned)} parameters ({', '.join(owned[:3])}) that a ZeRO optimizer "
            f"manages (the optimizer ap.parallelize / ap.shard_optimizer returned): step that optimizer instead "
            f"(PaddleFormers: Trainer(..., optimizers=(opt, None)))")


def _check_build_finished(opt) -> None:
    """A plain optimizer over a model built by ``ap.DataParallel(model, strategy=s)`` whose ``ap.Optimizer`` was
    never called: the strategy's optimizer options (ZeRO, accumulation, float16 loss scaling, checkpoints) act
    through ``ap.Optimizer`` and would be ignored by a plain step; refused, naming them."""
    from autoparallel.entry_points import OPTIMIZER_FIELDS, non_default
    from autoparallel.parallel.builds import find_build

    build, _ = find_build(list(flat_params(opt)))
    if build is None or build.optimizer_built:
        return
    s = build.strategy
    bad = [f"{n}={v!r}" for n, v in non_default(s).items() if n.startswith(OPTIMIZER_FIELDS)]
    if s.amp.enable and s.amp.dtype == "float16":
        bad.append("amp.dtype='float16' (loss scaling)")
    if bad:
        raise ValueError(f"{type(opt).__name__}.step over a model built by ap.DataParallel(strategy=...) with "
                         f"{', '.join(bad)}: these act on the optimizer through ap.Optimizer, which was not called, "
                         f"so a plain step would ignore them; wrap it first: opt = ap.Optimizer(opt)")


def resolve(opt):
    """The optimizer to drive: ``opt``'s wrapper when it is a plain paddle optimizer over distributed
    parameters (for loss scalers that take the optimizer as an argument), else ``opt``."""
    import paddle

    if isinstance(opt, paddle.optimizer.Optimizer) and needs_wrapper(opt):
        return wrapper_for(opt)
    return opt


def _repointed(opt):
    """``opt`` after pointing parameters a layout replaced at their replacements (an optimizer built after
    ``ap.parallelize`` from parameters taken before it; stale_optimizers.repoint_stale)."""
    if _ctx.local_depth == 0:
        from autoparallel.parallel.stale_optimizers import repoint_stale

        repoint_stale(opt)
    return opt


def _step(orig):
    def step(self, *args, **kwargs):
        if not needs_wrapper(_repointed(self)):
            return orig(self, *args, **kwargs)
        if args or kwargs:
            raise NotImplementedError(f"{type(self).__name__}.step{args or ''} with arguments (a closure) over "
                                      f"distributed parameters is not supported; call loss.backward() then "
                                      f"opt.step()")
        return wrapper_for(self).step()
    return step


def _clear_grad(orig):
    def clear_grad(self, set_to_zero=True):
        if not needs_wrapper(self):
            return orig(self, set_to_zero)
        return wrapper_for(self).clear_grad(set_to_zero)
    return clear_grad


def _minimize(orig):
    def minimize(self, *args, **kwargs):
        if not needs_wrapper(_repointed(self)):
            return orig(self, *args, **kwargs)
        return wrapper_for(self).minimize(*args, **kwargs)
    return minimize


def install() -> None:
    """Patch every paddle optimizer class's own ``step`` / ``clear_grad`` / ``minimize`` (ledger: undone by
    ``ap.uninstall()``)."""
    import inspect

    import paddle

    from autoparallel import patches

    base = paddle.optimizer.Optimizer
    makers = {"step": _step, "clear_grad": _clear_grad, "minimize": _minimize}
    for cls in [c for c in vars(paddle.optimizer).values() if inspect.isclass(c) and issubclass(c, base)]:
        for name, make in makers.items():
            own = cls.__dict__.get(name)
            if own is not None and not getattr(own, "_ap_implicit", False):
                fn = make(own)
                fn._ap_implicit = True
                patches.patch(cls, name, fn)
