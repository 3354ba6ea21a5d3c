"""Local mode: while set, paddle ops run on plain local tensors and nothing is routed through rules
(used while executing local ops, collectives and optimizer steps on a rank's shards)."""
from __future__ import annotations

import contextlib

from autoparallel.context import state as _state


def in_local_mode() -> bool:
    return _state.local_depth > 0


@contextlib.contextmanager
def local_mode():
    _state.local_depth += 1
    try:
        yield
    finally:
        _state.local_depth -= 1
