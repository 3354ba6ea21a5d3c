"""Lazy, sharded initialisation of models built under ``paddle.LazyGuard``.

    paddle.seed(0)
    with paddle.LazyGuard():
        model = GPT(cfg)                       # parameters have shapes, no storage
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    model, opt = ap.parallelize(model, opt, strategy)      # each rank allocates only its shards

``ap.parallelize`` lays the parameters out (TP plans, replication, ZeRO-3 chunks) and then materialises
them; with ``ap.shard_layer`` / ``ap.shard_tensor`` call ``ap.materialize(model)`` yourself (or
``param.initialize()`` on each parameter, in creation order). Values equal the eager single-process build
after the same ``paddle.seed`` (every rank must use the same seed): each parameter's initial values are
drawn from the global generator in chunks, in creation order, and every rank keeps only its part.

GPU: the CPU random kernels continue one Mersenne-Twister stream from call to call, which makes chunked
draws exact. The GPU kernels (curand Philox) derive each element from (seed, offset, thread index) with
an offset advanced per launch by an amount that depends on the launch size, so on GPU chunked draws are
deterministic and identical on every rank but do not reproduce the values of one full-size eager call.
"""
from __future__ import annotations

import importlib

from autoparallel.lazy_init import order as _order

_order.install()

_EXPORTS = {
    "materialize": "autoparallel.lazy_init.params", "materialize_params": "autoparallel.lazy_init.params",
    "is_lazy": "autoparallel.lazy_init.params", "has_lazy": "autoparallel.lazy_init.params",
    "shard_lazy": "autoparallel.lazy_init.params", "InitReport": "autoparallel.lazy_init.params",
    "LazyInitStreamWarning": "autoparallel.lazy_init.params",
    "apply_zero_lazy": "autoparallel.lazy_init.zero", "LazyZeroOptimizer": "autoparallel.lazy_init.zero",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'autoparallel.lazy_init' has no attribute {name!r}")
