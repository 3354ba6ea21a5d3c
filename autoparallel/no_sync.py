"""``model.no_sync()`` on a distributed model: paddle.DataParallel's context for gradient accumulation.

    for i, (x, y) in enumerate(micro_batches):
        ctx = model.no_sync() if i < k - 1 else contextlib.nullcontext()
        with ctx:
            (loss_fn(model(x), y) / k).backward()      # inside: gradients accumulate locally, no reduction
    opt.step(); opt.clear_grad()                       # the last backward (outside) reduced the sum

paddle's semantics: inside the context, backward accumulates each rank's gradients without synchronising
them; the first backward outside it reduces everything accumulated. Here the data-parallel reductions are
launched by backward hooks (parallel/reducer.py, ZeRO 1/2/3 included); inside ``no_sync`` a gradient
arriving for one of the model's parameters is not counted toward its bucket, so no bucket launches and the
gradient stays whole on its rank; the next backward outside counts and launches as usual. A step taken
while some gradients were never synchronised (only ``no_sync`` backwards since the last step) reduces them
at the step, so the values stay those of one process (paddle would step each rank on its own gradients).
Tensor-parallel collectives and ZeRO-3 parameter gathers are part of the computation and still run.

``no_sync`` exists on every ``paddle.nn.Layer`` holding a distributed parameter (``ap.parallelize`` /
``ap.DataParallel`` results, ``ap.shard_layer`` models, any sublayer of them); on other layers reading it
raises AttributeError as before, so code asking ``hasattr(model, "no_sync")`` (PaddleFormers' Trainer) sees
no change for plain models. ``paddle.DataParallel`` keeps its own method.
"""
from __future__ import annotations

import contextlib

from autoparallel import patches

_DEPTH: dict = {}                      # id(parameter) -> nesting depth of no_sync contexts holding it


def suspended(p) -> bool:
    """Whether a gradient of ``p`` arriving now belongs to a ``no_sync`` backward (not to be synchronised)."""
    return bool(_DEPTH) and id(p) in _DEPTH


@contextlib.contextmanager
def _no_sync(layer):
    params = _dist_params(layer)
    for p in params:
        _DEPTH[id(p)] = _DEPTH.get(id(p), 0) + 1
    try:
        yield
    finally:
        for p in params:
            n = _DEPTH.pop(id(p), 1) - 1
            if n:
                _DEPTH[id(p)] = n


def _dist_params(layer) -> list:
    from autoparallel.dist_tensor import is_dist

    # the parameter tables directly: paddle.jit.save reads every attribute of a layer while it builds a static
    # program, where Layer.parameters() fails (its de-duplication set takes only program values)
    found = {id(p): p for sub in layer.sublayers(include_self=True) for p in sub._parameters.values()
             if p is not None and is_dist(p)}
    return list(found.values())


def _get(self):
    from autoparallel import trainer_forms

    trainer_forms.install()                 # PaddleFormers' Trainer asks for no_sync before each step
    if not _dist_params(self):
        raise AttributeError(f"'{type(self).__name__}' object has no attribute 'no_sync' (it exists on a model "
                             f"with distributed parameters and on paddle.DataParallel)")
    return lambda: _no_sync(self)


def install() -> None:
    import paddle

    if isinstance(paddle.nn.Layer.__dict__.get("no_sync"), _NoSync):
        return
    patches.patch(paddle.nn.Layer, "no_sync", _NoSync())


class _NoSync:
    """The ``no_sync`` attribute of a Layer (a non-data descriptor: a subclass's own ``no_sync`` wins)."""

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return _get(obj)
