"""Human-readable bytes and seconds for plan explanations."""
from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """``0 B``, ``384 B``, ``1.5 KiB``, ``32 MiB``."""
    if n == int(n) and abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.4g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_seconds(s: float) -> str:
    """``0 us``, ``12.3 us``, ``4.56 ms``, ``1.2 s``."""
    if s == 0:
        return "0 us"
    if s < 1e-3:
        return f"{s * 1e6:.3g} us"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"
