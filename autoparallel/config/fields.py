"""Per-field checks of the strategy configs: (qualified name, value) -> normalised value, or TypeError /
ValueError naming the field, what was expected and what was given."""
from __future__ import annotations

import difflib
import math
import numbers
import os
from dataclasses import field

import numpy as np


def _join_or(items) -> str:
    items = [repr(i) if isinstance(i, str) else str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def integral(v):
    """``v`` as a python int when it is an integer (numpy's included, bools excluded), else None."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
        return None
    return int(v)


def _bool(name, v):
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {v!r}")
    return bool(v)


def _int(lo=1, optional=False, hi=None, hi_text=None):
    def check(name, v):
        if v is None and optional:
            return None
        if integral(v) is None:
            expected = f"an integer >= {lo}" + (" or None" if optional else "")
            raise TypeError(f"{name} must be {expected}, got {v!r}")
        if v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise ValueError(f"{name} must be an integer in [{lo}, {hi_text or hi}], got {v}")
        return int(v)
    return check


def _float(lo=0.0, hi=None, lo_open=True, hi_open=True):
    def check(name, v):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} must be a number, got {v!r}")
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v}")
        bad_lo = v <= lo if lo_open else v < lo
        bad_hi = hi is not None and (v >= hi if hi_open else v > hi)
        if bad_lo or bad_hi:
            rng = f"{'>' if lo_open else '>='} {lo:g}" + (f" and {'<' if hi_open else '<='} {hi:g}" if hi is not None else "")
            raise ValueError(f"{name} must be {rng}, got {v:g}")
        return v
    return check


def _choice(*choices):
    def check(name, v):
        if all(isinstance(c, int) for c in choices) and (isinstance(v, (bool, np.bool_))
                                                          or not isinstance(v, numbers.Integral)):
            raise TypeError(f"{name} must be {_join_or(choices)} (an int), got {type(v).__name__} {v!r}")
        if isinstance(v, (bool, np.bool_)) or v not in choices:
            raise ValueError(f"{name} must be {_join_or(choices)}, got {v!r}")
        return choices[choices.index(v)]          # the choice itself: an int for numpy ints
    return check


def _path(name, v):
    if isinstance(v, os.PathLike):
        v = os.fspath(v)
    if not isinstance(v, str) or not v:
        raise TypeError(f"{name} must be a non-empty path string, got {v!r}")
    return v


def _names(name, v):
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
        raise TypeError(f"{name} must be a list of layer names (non-empty strings), got {v!r}")
    return list(v)


def _field(default, check, factory=None):
    if factory is not None:
        return field(default_factory=factory, metadata={"check": check})
    return field(default=default, metadata={"check": check})


def _unknown_message(section: str, names, valid) -> str:
    hints = []
    for n in names:
        close = difflib.get_close_matches(n, valid, n=1)
        if close:
            hints.append(f"{n!r} -> did you mean {close[0]!r}?")
    hint = f" ({'; '.join(hints)})" if hints else ""
    return f"{section} has no field {', '.join(repr(n) for n in names)}{hint}; valid fields: {', '.join(valid)}"
