"""Layouts pinned op by op: whole-graph completion decides every routed op's layouts ahead of a forward, and
the forward replays them (``pinned``); a recompute region re-run in backward replays its own entries
(``replayable``). The pinned plan of this thread lives in ``autoparallel.context`` (``state.pinned``)."""
from __future__ import annotations

import contextlib

from autoparallel.context import state as _ctx


class PinnedLayouts:
    """Layouts decided ahead of time (by whole-graph completion): the k-th routed op of a forward uses
    ``results[k]`` (an SpmdResult from its rule) instead of asking the rule again. ``None`` entries fall
    back to the rule. An op-name mismatch means the forward differs from the traced one: an error."""

    def __init__(self, ops, results, base: int = 0):
        self.ops, self.results, self.k, self.base = list(ops), list(results), 0, base

    def next(self, op, input_specs):
        if self.k >= len(self.ops):
            raise RuntimeError(f"pinned layouts cover {len(self.ops)} ops but the forward ran more "
                               f"(op {self.base + self.k}: {op}); re-trace the model")
        want, res = self.ops[self.k], self.results[self.k]
        if want != op:
            raise RuntimeError(f"pinned layouts expected op {self.base + self.k} to be {want!r}, the forward ran "
                               f"{op!r}; re-trace the model")
        self.k += 1
        return res

    def segment(self, start: int, end: int) -> "PinnedLayouts":
        """Entries ``start:end`` again, from the beginning (a recomputed region re-run in backward)."""
        return PinnedLayouts(self.ops[start:end], self.results[start:end], self.base + start)


@contextlib.contextmanager
def pinned(ops, results):
    """Run a forward with layouts pinned op by op (see PinnedLayouts)."""
    with _pins_as(PinnedLayouts(ops, results)) as plan:
        yield plan


@contextlib.contextmanager
def _pins_as(plan):
    prev = _ctx.pinned
    _ctx.pinned = plan
    try:
        yield plan
    finally:
        _ctx.pinned = prev


def replayable(fn):
    """``fn`` as a recompute region. While tracing, the ops it records carry the region's number
    (``tracer.region``). Under pinned layouts its first call consumes entries as usual and remembers which;
    a later call (the region re-run in backward, after the pinned forward has ended) replays exactly those
    entries, so the recomputed activations have the layouts of the original ones."""
    seen = {}

    def wrapper(*args, **kwargs):
        tracer = _ctx.tracer
        if tracer is not None:
            return _traced_region(tracer, fn, args, kwargs)
        if seen:
            return _replay(seen, fn, args, kwargs)
        pins = _ctx.pinned
        seen.update(pins=pins, start=pins.k if pins is not None else 0)
        out = fn(*args, **kwargs)
        seen["end"] = pins.k if pins is not None else 0
        return out

    wrapper.__wrapped__ = fn
    return wrapper


def _traced_region(tracer, fn, args, kwargs):
    prev = getattr(tracer, "region", None)
    tracer.region = getattr(tracer, "regions", 0)
    tracer.regions = tracer.region + 1
    try:
        return fn(*args, **kwargs)
    finally:
        tracer.region = prev


def _replay(seen, fn, args, kwargs):
    pins = seen["pins"]
    segment = None if pins is None else pins.segment(seen["start"], seen["end"])
    with _pins_as(segment):
        out = fn(*args, **kwargs)
    if segment is not None and segment.k != len(segment.ops):
        last = segment.base + len(segment.ops) - 1
        raise RuntimeError(f"the recomputed region ran {segment.k} ops, its pinned forward {len(segment.ops)} "
                           f"(ops {segment.base}..{last}); re-trace the model")
    return out
