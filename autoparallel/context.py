"""Every mode autoparallel keeps per thread, in one place.

``state`` is a ``threading.local`` whose class attributes are the neutral values, so a thread that never set
a mode reads the default without the cost of a missing-attribute lookup (the dispatch hot path reads several
of these on every call). Modules keep their own small accessors (``in_local_mode()``, ``trace.active()``,
``current_world()`` ...); they read and write the fields here.

=================  ==========================================================  ===========================
field              meaning                                                     set by
=================  ==========================================================  ===========================
local_depth        > 0 while ops run on plain local shards (no routing)         ``local_mode()``, dispatch
tracer             the graph tracer recording routed ops, or None              ``graph.trace.tracing``
pinned             layouts pinned op by op for this forward, or None           ``dispatch.pinned``
world_stack        simulated worlds entered (innermost last), or None          ``ap.simulate``
lowering_depth     > 0 while a to_static function builds its program           ``graph.jit``
lowering_swapped   parameters whose shards are swapped for program values      ``graph.jit``
async_allreduce    ``backward(use_async_allreduce=...)``: None/True/False        ``parallel.grads``
wgrad_store        zero-bubble weight-gradient store and key being captured    ``pipeline.zero_bubble``
wgrad_key
guard_stack        ``ap.parallel_guard(dims)`` entered (innermost last)         ``parallelize``
=================  ==========================================================  ===========================

One process-wide value lives here too, since it changes what runtime reshards cost: ``cluster`` (the
``ap.set_cluster`` override, None for the default). Every change bumps the reshard cache's epoch
(``reshard.cache.cluster_epoch()``), so caches key on a number instead of an object's ``id()``.
"""
from __future__ import annotations

import contextlib
import threading


class _ThreadModes(threading.local):
    local_depth = 0
    tracer = None
    pinned = None
    world_stack = None
    lowering_depth = 0
    lowering_swapped = None
    async_allreduce = None
    wgrad_store = None
    wgrad_key = None
    guard_stack = None


state = _ThreadModes()


class _ProcessModes:
    cluster = None


process = _ProcessModes()


def set_cluster_override(cluster) -> None:
    from reshard.cache import bump_epoch

    process.cluster = cluster
    bump_epoch()


@contextlib.contextmanager
def async_allreduce(flag):
    """``loss.backward(use_async_allreduce=flag)``: None keeps the default (asynchronous where the backend
    overlaps), True asks for it (a no-op on gloo, whose collectives block), False turns it off."""
    if flag is not None and not isinstance(flag, bool):
        raise TypeError(f"use_async_allreduce must be True, False or None, got {flag!r}")
    old = state.async_allreduce
    state.async_allreduce = flag
    try:
        yield
    finally:
        state.async_allreduce = old
