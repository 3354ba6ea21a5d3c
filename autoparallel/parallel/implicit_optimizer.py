"""A plain paddle optimizer over distributed parameters behaves as ``ap.shard_optimizer(opt)``.

Paddle lets a user step an optimizer built over the parameters of a layer distributed with
``shard_layer`` without wrapping it. Here a distributed parameter's gradient lives on its local shards
(and, for a data-parallel layout, is still a partial sum), so paddle's own ``step`` would find no
gradient and update nothing: the model would silently not train. While dispatch is installed,
``step`` / ``clear_grad`` of a paddle optimizer holding a distributed parameter therefore run through
a ``ShardedOptimizer`` kept for that optimizer; ``minimize`` is the wrapper's (a step). The wrapper is made as
the first distributed backward starts (``wrap_before_backward``), or at the first step: its backward hooks
reduce the data-parallel gradients, so ``p.grad`` read between ``backward()`` and ``step()`` holds the sum over
the ranks, as paddle's ``p.grad.numpy()`` does (a rank's partial sum before), and more ``backward()`` calls
before a step still accumulate as paddle's do (reducer.py). An ap wrapper calls the inner optimizer in local
mode, where the original methods run unchanged.
"""
from __future__ import annotations

import warnings
import weakref

from autoparallel.compat import SideData
from autoparallel.context import state as _ctx
from autoparallel.dist_tensor import is_dist
from autoparallel.parallel.param_list import flat_params

_WRAPPERS = SideData()          # paddle optimizer -> its ShardedOptimizer
_ELSEWHERE: "weakref.WeakSet" = weakref.WeakSet()   # optimizers whose parameters another reduction owns
_WARNED: list = []                                  # the unheld-parameters warning was given


def needs_wrapper(opt) -> bool:
    """A paddle optimizer, called outside an ap wrapper, that holds a distributed parameter."""
    return _ctx.local_depth == 0 and any(is_dist(p) for p in flat_params(opt))


def wrapper_for(opt):
    w = _WRAPPERS.get(opt)
    if w is None:
        from autoparallel.parallel.optimizer import ShardedOptimizer

        _check_not_zero(opt)
        _check_build_finished(opt)
        w = ShardedOptimizer(opt, None, 1, overlap=True)
        _take_over(w.grad_sync)
        _WRAPPERS.set(opt, w)
    return w


def _take_over(sync) -> None:
    """Another optimizer's reduction still owning these parameters (the optimizer ``ap.parallelize`` returned,
    replaced by this plain one while alive; the one driving this optimizer when it is stepped directly) would
    reduce their gradients too: twice the sum. It finishes this step's reduction and hands them over."""
    from autoparallel import backward_start
    from autoparallel.parallel.grads import owners_of

    for old in owners_of(sync.params_fn()):
        if old is sync:
            continue
        old.flush()                             # the gradients of this step: reduced once, now
        old.retired = True
        backward_start.forget(old)
        if old.reducer is not None:
            old.reducer.detach()
        sync._flushed |= {id(p) for p in old.params_fn()}     # this step's flush leaves them


def wrap_before_backward(tensors=()) -> None:
    """As a distributed backward starts: every live plain paddle optimizer over data-parallel (partial-gradient)
    parameters that no ap optimizer drives gets its wrapper now, whose reduction then runs from this backward's
    hooks. One whose build is refused at its step (``_check_not_zero``, ``_check_build_finished``) is left to
    raise there."""
    from autoparallel.dist_tensor_forms import ZERO_OWNERS
    from autoparallel.parallel.grads import owners_of, partial_params
    from autoparallel.parallel.stale_optimizers import live_optimizers
    from autoparallel.parallel.step_hooks import is_inner

    if _ctx.local_depth:
        return
    for opt in live_optimizers():
        if _WRAPPERS.get(opt) is not None or opt in _ELSEWHERE or is_inner(opt):
            continue
        params = list(flat_params(opt))
        if not any(is_dist(p) for p in params):
            continue                            # not distributed (yet)
        zero = [p for p in params if ZERO_OWNERS.get(p) is not None and ZERO_OWNERS.get(p)() is not None]
        if zero or owners_of(params):
            _ELSEWHERE.add(opt)                 # the inner optimizer of an ap wrapper, or a ZeRO one's
            continue
        partial = partial_params(params)
        if not partial or not _in_this_world(partial):
            continue                            # nothing to reduce (yet), or another simulated world's model
        try:
            w = wrapper_for(opt)
        except (ValueError, NotImplementedError):
            _ELSEWHERE.add(opt)
            continue
        w.grad_sync.before_backward(tensors)
    _warn_unheld()


def _in_this_world(params) -> bool:
    """Whether every mesh of ``params`` lies in the current world (a model left from an earlier ``ap.simulate``
    of more ranks does not)."""
    from autoparallel.comm.world import current_world

    world = current_world()
    try:
        for p in params:
            world.local_ranks(p.mesh.process_ids)
    except ValueError:
        return False
    return True


def _warn_unheld() -> None:
    """Partial-gradient parameters that no optimizer holds are reduced by nothing: their ``p.grad`` stays each
    rank's part of the sum (paddle's ``p.grad.numpy()`` would gather the sum). Said once, of the parameters that
    became partial since the last backward (a model left over from earlier work is not named again)."""
    from autoparallel.backward_start import new_partial
    from autoparallel.parallel.stale_optimizers import live_optimizers

    fresh = new_partial()
    if _WARNED or not fresh:
        return
    held = {id(p) for opt in live_optimizers() for p in flat_params(opt)}
    unheld = [p.name for p in fresh if id(p) not in held and not p.stop_gradient]
    if unheld:
        _WARNED.append(True)
        warnings.warn(f"{len(unheld)} data-parallel parameter(s) ({', '.join(unheld[:3])}) are held by no optimizer: "
                      f"nothing sums their gradients over the ranks, so p.grad holds this rank's part of the sum "
                      f"until an optimizer over them steps (ap.shard_optimizer, or a paddle optimizer); to read "
                      f"the whole gradient without one, all-reduce p.grad yourself", UserWarning, stacklevel=4)


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

    from autoparallel import backward_start

    backward_start.at_start(wrap_before_backward)
    base = paddle.optimizer.Optimizer
    makers = {"step": _step, "clear_grad": _clear_grad, "minimize": _minimize}
    for cls in [c for c in vars(paddle.optimizer).values() if inspect.isclass(c) and issubclass(c, base)]:
        for name, make in makers.items():
            own = cls.__dict__.get(name)
            if own is not None and not getattr(own, "_ap_implicit", False):
                fn = make(own)
                fn._ap_implicit = True
                patches.patch(cls, name, fn)
