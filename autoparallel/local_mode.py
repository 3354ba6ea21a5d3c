"""Local mode: while set, paddle ops run on plain local tensors and nothing is routed through rules
(used while executing local ops, collectives and optimizer steps on a rank's shards)."""
from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def in_local_mode() -> bool:
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def local_mode():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
