"""Zero-bubble backward split: a Linear's backward as an input-gradient part (B) and a weight-gradient part (W).

``install(layer)`` makes every ``paddle.nn.Linear`` under ``layer`` run ``deferrable_linear``: a PyLayer
whose backward computes the input gradient ``g @ W^T`` at once and, inside ``WeightGradStore.capture(key)``,
files the weight gradient ``x^T g`` (and the bias gradient ``sum(g)``) under ``key`` instead of computing it;
``flush(key)`` (the schedule's W action) computes and accumulates them into ``weight.grad`` /
``bias.grad``. Only leaf tensors (parameters) are deferred: a weight or bias that reaches the op through
other ops (under tensor parallelism a row-parallel bias enters as a ``Partial`` conversion of the
parameter) gets its gradient back through autograd in B. Outside ``capture`` every gradient is computed
immediately, so an installed layer trains exactly like before. Every other op (embeddings, norms,
attention, a tied head's matmul) runs its backward whole in B.

The function is registered as a custom op under the ``linear`` spmd rule, so on distributed tensors
(data or tensor parallel inside a stage) dispatch lays out its inputs as for ``F.linear`` and the PyLayer
runs on each rank's shards: the deferred weight gradient is the local shard's gradient.
"""
from __future__ import annotations

import contextlib
import types

import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.autograd import PyLayer

from autoparallel import layer_state  # noqa: E402
from autoparallel.context import state as _state  # noqa: E402


def _active():
    return _state.wgrad_store, _state.wgrad_key


class WeightGradStore:
    """Deferred weight-gradient work, keyed by (stage, micro-batch)."""

    def __init__(self):
        self.pending: dict = {}

    @contextlib.contextmanager
    def capture(self, key):
        """Backward passes inside file their Linear weight gradients under ``key``."""
        prev = _active()
        _state.wgrad_store, _state.wgrad_key = self, key
        self.pending.setdefault(key, [])
        try:
            yield
        finally:
            _state.wgrad_store, _state.wgrad_key = prev

    def add(self, key, work) -> None:
        self.pending.setdefault(key, []).append(work)

    def flush(self, key) -> int:
        """Compute and accumulate the weight gradients filed under ``key``; returns how many."""
        from autoparallel.local_mode import local_mode

        works = self.pending.pop(key, [])
        with paddle.no_grad(), local_mode():
            for work in works:
                _weight_grads(*work)
        return len(works)

    def __len__(self) -> int:
        return sum(len(v) for v in self.pending.values())


def _accumulate(param, grad) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _weight_grads(x, g, weight, bias) -> None:
    x2 = x.reshape([-1, x.shape[-1]])
    g2 = g.reshape([-1, g.shape[-1]])
    if weight is not None and not weight.stop_gradient:
        _accumulate(weight, paddle.matmul(x2, g2, transpose_x=True).astype(weight.dtype))
    if bias is not None and not bias.stop_gradient:
        _accumulate(bias, g2.sum(axis=0).astype(bias.dtype))


def _deferrable(t) -> bool:
    """Only a leaf (a parameter) can have its gradient filed and set later. A weight or bias that reaches the
    op through other ops (a tensor-parallel bias made Partial, a gathered ZeRO-3 shard) gets its gradient
    through autograd at once, which carries it back to the parameter."""
    return t is not None and not t.stop_gradient and t.is_leaf


def _backward(x, weight, bias, g):
    """(input grad, weight grad, bias grad): the input gradient now; a leaf weight's / bias's gradient now or
    filed under the active key (then None is returned for it); a non-leaf one's returned now. Runs on local
    tensors (a DistParameter weight is this rank's shard), so ops here bypass dispatch."""
    from autoparallel.local_mode import local_mode

    with local_mode():
        gx = paddle.matmul(g, weight, transpose_y=True)
        store, key = _active()
        defer_w = store is not None and _deferrable(weight)
        defer_b = store is not None and _deferrable(bias)
        if defer_w or defer_b:
            store.add(key, (x.detach(), g.detach(), weight if defer_w else None, bias if defer_b else None))
        with paddle.no_grad():
            x2 = x.reshape([-1, x.shape[-1]])
            g2 = g.reshape([-1, g.shape[-1]])
            gw = None if defer_w or weight.stop_gradient else \
                paddle.matmul(x2, g2, transpose_x=True).astype(weight.dtype)
            gb = None if bias is None or defer_b or bias.stop_gradient else g2.sum(axis=0).astype(bias.dtype)
    return gx, gw, gb


class _Linear(PyLayer):
    """The weight is kept on ``ctx`` itself, not saved: under recompute a saved tensor comes back from the
    re-run as a new tensor (not the parameter, no gradient), which would neither be deferred nor get one."""
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x)
        ctx.weight = weight
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensor()
        gx, gw, _ = _backward(x, ctx.weight, None, g)
        return gx, gw


class _LinearBias(PyLayer):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias = weight, bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensor()
        return _backward(x, ctx.weight, ctx.bias, g)


def _local_linear(x, weight, bias=None):
    if bias is None:
        return _Linear.apply(x, weight)
    return _LinearBias.apply(x, weight, bias)


def _dispatchable():
    from autoparallel.dispatch import custom_op

    return custom_op("linear")(_local_linear)


_DEFERRABLE = None


def deferrable_linear(x, weight, bias=None):
    """``F.linear`` whose weight gradient can be deferred (see the module docstring)."""
    global _DEFERRABLE
    if _DEFERRABLE is None:
        _DEFERRABLE = _dispatchable()
    return _DEFERRABLE(x, weight, bias)


def _forward(self, x):
    return deferrable_linear(x, self.weight, self.bias)


def install(layer) -> int:
    """Route every ``nn.Linear`` under ``layer`` (itself included) through ``deferrable_linear``; returns the
    number of Linear layers changed (idempotent)."""
    n = 0
    for _, sub in layer.named_sublayers(include_self=True):
        if isinstance(sub, nn.Linear) and not layer_state.get(sub, "zero_bubble", False):
            sub.forward = types.MethodType(_forward, sub)
            layer_state.put(sub, "zero_bubble", True)
            n += 1
    return n
