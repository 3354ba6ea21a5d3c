"""Composite ops (see composites.py) computed on the whole tensors: ``F.hsigmoid_loss``,
``F.fractional_max_pool2d`` / ``3d``, ``F.gather_tree``, ``F.rnnt_loss``, ``linalg.lstsq`` (its outputs' shapes
depend on the driver and the device), ``linalg.svd_lowrank`` / ``pca_lowrank`` (random projections: one
process's draw). Each distributed argument is gathered
(``full()``: differentiable, so every input's gradient flows back to its shards), paddle's own function runs on
the global values (one process's result, the random pooling regions of one process's draw included), and the
result comes back whole: a plain tensor, replicated next to distributed operands (the convention of
``multinomial``). Correct for every layout; the gather is the price of an op this rare."""
from __future__ import annotations


def _whole(v):
    if hasattr(v, "full") and hasattr(v, "placements"):
        return v.full()
    if isinstance(v, (list, tuple)):
        return type(v)(_whole(x) for x in v)
    return v


def _on_whole(path):
    def fn(*args, **kwargs):
        import importlib

        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)(*_whole(args), **{k: _whole(v) for k, v in
                                                                                kwargs.items()})

    fn.__name__ = path.rsplit(".", 1)[-1]
    return fn


PATHS = tuple(f"paddle.nn.functional.{n}" for n in ("hsigmoid_loss", "fractional_max_pool2d",
                                                      "fractional_max_pool3d", "gather_tree", "rnnt_loss")) + \
    tuple(f"paddle.linalg.{n}" for n in ("lstsq", "svd_lowrank", "pca_lowrank"))
COMPOSITES: dict = {p: _on_whole(p) for p in PATHS}
