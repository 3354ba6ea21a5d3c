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


def rss_bytes() -> int:
    """This process's resident set size now (Linux /proc; elsewhere the peak, the best the OS tells)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _page_size()
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024       # Linux reports KiB, macOS bytes


def _page_size() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE")
