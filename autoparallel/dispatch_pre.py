"""Steps paddle's python takes before its C op, taken on distributed tensors before the op's rule.

``F.embedding(x, w, max_norm=m)`` first rescales, in place, the rows of ``w`` that ``x`` looks up to a norm of at
most ``m`` (``F.embedding_renorm_``), then looks them up. On distributed tensors the renorm runs as paddle writes
it (each step routed: the norms are of whole rows, the write reaches the weight in whatever layout it has) and
the lookup's rule sees ``max_norm=None``; inside the rule a renorm of one rank's rows from one rank's ids would
leave the replicas apart, or rescale a gathered copy rather than the weight.
"""
from __future__ import annotations

import inspect

import paddle.nn.functional as F

from autoparallel.context import state as _ctx
from autoparallel.dist_tensor import is_dist


def _embedding_renorm_first(orig, args, kwargs):
    bound = inspect.signature(orig).bind(*args, **kwargs)
    arguments = bound.arguments
    max_norm = arguments.get("max_norm")
    weight = arguments.get("weight")
    if not max_norm or weight is None or _ctx.tracer is not None or _size(weight) == 0:
        return args, kwargs
    ids = arguments["x"]
    if not is_dist(weight) and is_dist(ids):      # a plain weight (replicated) renormed by every id on every rank
        ids = ids.full()
    F.embedding_renorm_(ids, weight, max_norm=max_norm, norm_type=arguments.get("norm_type", 2.0))
    arguments["max_norm"] = None
    return bound.args, bound.kwargs


def _size(t) -> int:
    n = 1
    for s in getattr(t, "global_shape", None) or t.shape:
        n *= s
    return n


PRE_STEPS = {"embedding": _embedding_renorm_first}       # op -> (paddle callable, args, kwargs) -> (args, kwargs)


def pre_step(op, orig, args, kwargs):
    """The call's arguments after the op's pre-step (unchanged for an op without one)."""
    step = PRE_STEPS.get(op)
    return (args, kwargs) if step is None or orig is None else step(orig, args, kwargs)
