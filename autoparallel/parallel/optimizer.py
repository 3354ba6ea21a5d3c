"""shard_optimizer (paddle's signature): reduce partial gradients, then step on local shards."""
from __future__ import annotations

from autoparallel.dispatch import local_mode
from autoparallel.parallel.grads import reduce_gradients


class ShardedOptimizer:
    """Wraps a paddle optimizer built over a distributed model's parameters."""

    def __init__(self, optimizer, shard_fn=None, gradient_accumulation_steps: int = 1):
        if not hasattr(optimizer, "step") or not hasattr(optimizer, "clear_grad"):
            raise TypeError(f"shard_optimizer expects a paddle optimizer, got {type(optimizer).__name__}")
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {gradient_accumulation_steps!r}")
        self._inner = optimizer
        self._shard_fn = shard_fn
        self.gradient_accumulation_steps = gradient_accumulation_steps

    @property
    def parameters(self):
        return list(self._inner._parameter_list)

    def reduce_gradients(self):
        return reduce_gradients(self.parameters)

    def step(self):
        self.reduce_gradients()
        with local_mode():
            self._inner.step()

    def clear_grad(self, set_to_zero: bool = True):
        with local_mode():
            self._inner.clear_grad(set_to_zero=set_to_zero)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def shard_optimizer(optimizer, shard_fn=None, gradient_accumulation_steps: int = 1) -> ShardedOptimizer:
    return ShardedOptimizer(optimizer, shard_fn, gradient_accumulation_steps)
