"""The optimizer of a parallelized model: pointed at the distributed parameters, stepping once per
``gradient_accumulation_steps`` backward passes, the step averaging them (paddle's ``gradient_merge`` with
``avg=True``; ``ap.shard_optimizer(..., gradient_accumulation_steps=k)`` leaves the division to the loop, as
paddle's)."""
from __future__ import annotations

from autoparallel.dist_tensor import is_dist
from autoparallel.local_mode import local_mode
from autoparallel.parallel.optimizer import ShardedOptimizer
from autoparallel.parallel.param_list import flat_params, rebind_params as _rebind


class AccumulatingOptimizer(ShardedOptimizer):
    """``Strategy.gradient_accumulation_steps`` for gradient accumulation: ``step()`` runs once per
    ``gradient_accumulation_steps`` backward passes; the gradients, reduced over the data axis in buckets
    (by the final micro-step's backward hooks, the rest at the step), are divided by that number and the
    local shards updated."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.grad_sync.step_divisor = self._divisor     # a clip by hand before the step sees the mean

    def _divisor(self) -> float:
        return float(self.gradient_accumulation_steps)

    @property
    def parameters(self):
        return list(flat_params(self._inner))

    def _scale_gradients(self):
        k = self.gradient_accumulation_steps
        if k > 1:
            with local_mode():
                for p in self.parameters:
                    for t in (p.locals.values() if is_dist(p) else [p]):
                        if t.grad is not None:
                            t.grad.set_value(t.grad * (1.0 / k))


def wrap_optimizer(optimizer, replaced: dict, gradient_accumulation_steps: int = 1,
                   where: str | None = None) -> AccumulatingOptimizer:
    """Point the optimizer at the distributed parameters and wrap it (idempotent on a wrapped one); ``where``: the
    entry point whose strategy gives ``gradient_accumulation_steps`` (checked against a shard_optimizer window)."""
    if where is not None:
        check_loop_window(optimizer, gradient_accumulation_steps, where)
    if isinstance(optimizer, ShardedOptimizer):
        retire_wrapper(optimizer)
        optimizer = optimizer._inner
    if not hasattr(optimizer, "_parameter_list"):
        raise TypeError(f"expected a paddle optimizer, got {type(optimizer).__name__}")
    if not optimizer._parameter_list:
        raise ValueError("the optimizer has no parameters; build it with parameters=model.parameters()")
    _rebind(optimizer, replaced)
    return AccumulatingOptimizer(optimizer, gradient_accumulation_steps=gradient_accumulation_steps, overlap=True)


def retire_wrapper(wrapper) -> None:
    """A wrapper handed to an entry point (``ap.shard_optimizer``'s, held on by the caller) reduces nothing from
    now on: the new wrapper owns its parameters, and two reductions of one gradient would sum it twice."""
    from autoparallel import backward_start

    sync = wrapper.grad_sync
    backward_start.forget(sync)
    sync.retired = True
    if sync.reducer is not None:
        sync.reducer.detach()


def check_loop_window(optimizer, k: int, where: str) -> None:
    """``ap.shard_optimizer(opt, ..., gradient_accumulation_steps=n)`` leaves the division to the loop, the strategy's
    ``gradient_accumulation_steps = k`` of an entry point divides in the step: both (n, k > 1) would divide twice,
    and ap.to_static (whose train_step runs k micro-batches) would drop a window n != k."""
    n = optimizer.gradient_accumulation_steps if type(optimizer) is ShardedOptimizer else 1
    if n == 1 or (n == k if where == "ap.to_static" else k == 1):
        return
    if where == "ap.to_static":
        expected = f"strategy.gradient_accumulation_steps={n} (train_step then runs {n} micro-batches, averaged)"
    else:
        expected = ("strategy.gradient_accumulation_steps=1 (the loop divides its loss) or the paddle optimizer "
                    "itself (the step divides)")
    raise ValueError(f"{where}: the optimizer comes from ap.shard_optimizer(..., gradient_accumulation_steps={n}), "
                     f"whose loop divides its loss, and the strategy has gradient_accumulation_steps={k}; expected "
                     f"{expected}")


def check_optimizer_params(model, optimizer, where: str, replaced: dict | None = None) -> None:
    """The optimizer must update the model's parameters (all or some): name how many are foreign."""
    if optimizer is None:
        return
    inner = optimizer._inner if isinstance(optimizer, ShardedOptimizer) else optimizer
    if not hasattr(inner, "_parameter_list"):
        return                                              # wrap_optimizer names the type error
    own = {id(p) for p in model.parameters()} | set(replaced or {})
    params = list(flat_params(inner))
    foreign = [p for p in params if id(p) not in own]
    if foreign:
        names = ", ".join(p.name for p in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(f"{where}: {len(foreign)} of the optimizer's {len(params)} parameters are not "
                         f"parameters of the {type(model).__name__} ({names}); build the optimizer with "
                         f"parameters=model.parameters() of this model")
