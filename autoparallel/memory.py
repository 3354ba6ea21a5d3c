"""Bytes held by live tensors: CPU paddle has no allocator statistics, so memory is counted from tensors."""
from __future__ import annotations


def live_bytes(tensors) -> int:
    """Bytes of the distinct, initialised tensors among ``tensors`` (None entries and repeats skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is not None and id(t) not in seen and t._is_initialized():
            seen.add(id(t))
            total += int(t.numel()) * t.element_size()
    return total
