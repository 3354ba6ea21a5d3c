"""Watchdog settings: defaults, the environment variables that override them, and checks of the arguments."""
from __future__ import annotations

import math
import os

PREFIX = "autoparallel watchdog"
DEFAULT_TIMEOUT = 10.0
LONG_WAIT_FACTOR = 2.0        # a long wait may stretch a running peer's silence to at most 2 x timeout
DEFAULT_EXIT_CODE = 75
RING_ABOVE = 16


class _Peer:
    __slots__ = ("rank", "up", "seq", "changed", "record", "clog_seen")

    def __init__(self, rank: int, now: float):
        self.rank, self.up, self.seq, self.changed, self.record = rank, False, None, now, {}
        self.clog_seen = None


def _env_float(name: str, default):
    text = os.environ.get(name)
    if text in (None, ""):
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive, got {text!r}")
    return value


def _seconds(name: str, value):
    """A positive finite number of seconds as float, or None when ``value`` is None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}")
    return float(value)


def _exit_code(value) -> int:
    try:
        code = int(value)
    except (TypeError, ValueError):
        raise TypeError(f"exit_code (AP_WATCHDOG_EXIT_CODE) must be an int in [1, 255], got {value!r}") from None
    if isinstance(value, bool) or not 1 <= code <= 255:
        raise ValueError(f"exit_code (AP_WATCHDOG_EXIT_CODE) must be in [1, 255] (0 would report success), "
                         f"got {value!r}")
    return code


def _check_peers(peers, rank: int, world_size: int) -> list:
    ranks = list(peers) if isinstance(peers, (list, tuple, set, frozenset)) else None
    if ranks is None or any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
        raise TypeError(f"peers must be a list of int ranks, got {peers!r}")
    bad = [r for r in ranks if not 0 <= r < world_size or r == rank]
    if bad:
        raise ValueError(f"peers must be other ranks in [0, {world_size}) (this rank is {rank}), got {bad}")
    return sorted(set(ranks))
