"""Argument checks shared by the command-line tools: sizes no cluster has are refused with a message naming the
flag and the bound (arithmetic on them stays well inside int64), and output paths are checked before any
work starts."""
from __future__ import annotations

import os

MAX_DEVICES = 2 ** 20            # devices in a cluster or a mesh: more than any machine room holds
MAX_GLOBAL_BATCH = 2 ** 24       # sequences per optimizer step
MAX_SEQ_LEN = 2 ** 24            # tokens per sequence
MAX_TOKENS = 2 ** 40             # tokens per optimizer step (global batch x sequence length)
MAX_TENSOR_BYTES = 2 ** 56       # 64 PiB: more than the memory of any cluster


def bounded(flag: str, value: int, high: int, what: str, low: int = 1) -> int:
    """``value`` if ``low <= value <= high``, else a ValueError naming ``flag``, the bound and ``what``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{flag} must be an integer, got {type(value).__name__} {value!r}")
    if value < low:
        expected = "a positive integer" if low == 1 else f"at least {low}"
        raise ValueError(f"{flag} must be {expected}, got {value}")
    if value > high:
        raise ValueError(f"{flag} {value} exceeds {high:,} {what}, more than any cluster runs")
    return value


def tensor_bytes(flag: str, shape, itemsize: int) -> int:
    """Bytes of a tensor of ``shape``, refused beyond MAX_TENSOR_BYTES (no int64 overflow on the way)."""
    total = itemsize
    for n in shape:
        total *= int(n)
        if total > MAX_TENSOR_BYTES:
            raise ValueError(f"{flag} {list(shape)} holds more than {MAX_TENSOR_BYTES:,} bytes (64 PiB): beyond the "
                             f"memory of any cluster")
    return total


def output_path(flag: str, path: str, suffixes=None) -> str:
    """``path`` if a file can be written there: its directory exists and is writable, it is not a directory,
    and its suffix is one of ``suffixes`` (when given). Checked before the work that produces it."""
    if not path:
        raise ValueError(f"{flag} needs a file path, got {path!r}")
    full = os.path.abspath(os.path.expanduser(path))
    parent = os.path.dirname(full)
    if os.path.isdir(full):
        raise ValueError(f"{flag} {path!r} is a directory, expected a file path")
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ValueError(f"{flag} {path!r}: the directory {parent!r} {what}; create it first")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(full) and not os.access(full, os.W_OK)):
        raise ValueError(f"{flag} {path!r}: not writable by this user")
    if suffixes is not None:
        suffix = os.path.splitext(full)[1].lstrip(".").lower()
        if suffix not in suffixes:
            raise ValueError(f"{flag} {path!r}: expected a file ending in one of "
                             f"{', '.join('.' + s for s in sorted(suffixes))}, got {'.' + suffix if suffix else 'none'}")
    return path
