"""Collective cost formulas, written once (ring / pairwise algorithms, alpha-beta model).

``b`` is the bytes one rank holds entering the collective, ``n`` the group size.
Bytes one rank sends:
    slice           0
    all_gather      (n-1)·b
    reduce_scatter  (n-1)/n·b
    all_reduce      2(n-1)/n·b
    all_to_all      (n-1)/n·b
    broadcast       b          (pipelined from the root)
    send_recv       b
Latency terms (number of sequential message steps): all_gather, reduce_scatter, all_to_all n-1;
all_reduce 2(n-1); broadcast and send_recv 1.
"""
from __future__ import annotations

from autoparallel.comm.capabilities import capabilities


def collective_bytes(collective: str, b: float, n: int) -> float:
    """Bytes one rank sends for ``collective`` over ``n`` ranks holding ``b`` bytes each."""
    if n <= 1 or collective in ("slice", "local", "none"):
        return 0.0
    return {
        "all_gather": (n - 1) * b,
        "reduce_scatter": (n - 1) / n * b,
        "all_reduce": 2 * (n - 1) / n * b,
        "all_to_all": (n - 1) / n * b,
        "broadcast": float(b),
        "send_recv": float(b),
    }[collective]


def collective_steps(collective: str, n: int) -> int:
    """Sequential message steps (latency terms) of ``collective`` over ``n`` ranks."""
    if n <= 1 or collective in ("slice", "local", "none"):
        return 0
    return {"all_gather": n - 1, "reduce_scatter": n - 1, "all_reduce": 2 * (n - 1),
            "all_to_all": n - 1, "broadcast": 1, "send_recv": 1}[collective]


def alpha_beta_seconds(collective: str, b: float, n: int, latency_s: float, bandwidth_Bps: float) -> float:
    """alpha·steps + bytes/bandwidth for a natively supported collective."""
    return collective_steps(collective, n) * latency_s + collective_bytes(collective, b, n) / bandwidth_Bps


def emulated_bytes(collective: str, b: float, n: int, backend: str = "nccl") -> float:
    """Bytes one rank sends for ``collective`` on ``backend``, including its emulation if it has none."""
    emu = capabilities(backend).emulation(collective)
    if emu is None:
        return collective_bytes(collective, b, n)
    if collective == "reduce_scatter":                    # all_reduce of the whole buffer, keep a slice
        return collective_bytes("all_reduce", b, n)
    if collective == "all_to_all":
        if n % 2:                                         # odd groups: all_gather of every chunk
            return collective_bytes("all_gather", b, n)
        return (n - 1) * collective_bytes("send_recv", b / n, 2)   # n-1 pairwise rounds of b/n
    raise NotImplementedError(collective)


def collective_seconds(collective: str, b: float, n: int, latency_s: float, bandwidth_Bps: float,
                       backend: str = "nccl") -> float:
    """Time of ``collective`` on ``backend``; a missing collective is priced as its emulation."""
    if n <= 1 or collective in ("slice", "local", "none"):
        return 0.0
    emu = capabilities(backend).emulation(collective)
    if emu is None:
        return alpha_beta_seconds(collective, b, n, latency_s, bandwidth_Bps)
    if collective == "reduce_scatter":
        return alpha_beta_seconds("all_reduce", b, n, latency_s, bandwidth_Bps)
    if collective == "all_to_all":
        if n % 2:
            return alpha_beta_seconds("all_gather", b, n, latency_s, bandwidth_Bps)
        return (n - 1) * alpha_beta_seconds("send_recv", b / n, 2, latency_s, bandwidth_Bps)
    raise NotImplementedError(collective)
