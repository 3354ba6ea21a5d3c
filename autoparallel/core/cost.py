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

from autoparallel.core.capabilities import capabilities


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


# ---------------------------------------------------------------------------------------------
# hierarchical collectives (intra-node then inter-node), as NCCL runs them on multi-node GPU clusters
# ---------------------------------------------------------------------------------------------
def _tree_depth(k: int) -> int:
    return max(1, (k - 1).bit_length()) if k > 1 else 0


def hierarchical_loads(collective: str, b: float, g: int, k: int, pxn: bool = False):
    """(intra-node bytes, inter-node bytes) one rank sends for ``collective`` over a group of g ranks per node
    on k nodes (n = g·k), ``b`` as in ``collective_bytes``.

    NCCL's rings pass through every rank; the ring volume (``collective_bytes``) crosses each node's NICs once
    per ring, shared by the node's g ranks on their own NIC rails, and its other hops are NVLink:
        inter = collective_bytes / g,  intra = collective_bytes · (g-1)/g      (k > 1)
    so the network reaches NCCL's bus bandwidth = the node's NIC bandwidth (the published anchor).
    all_to_all: (g-1)/n·b stays in the node, (n-g)/n·b crosses the network (and, with PXN on a rail-optimised
    fabric, also NVLink first to reach the GPU on the destination's rail).
    send_recv / broadcast: b on the one link the peers share.
    """
    n = g * k
    if n <= 1 or collective in ("slice", "local", "none"):
        return 0.0, 0.0
    if collective == "all_to_all":
        inter = (n - g) / n * b
        return (g - 1) / n * b + (inter if pxn else 0.0), inter
    if collective in ("send_recv", "broadcast"):
        return (float(b), 0.0) if k == 1 else (0.0, float(b))
    ring = collective_bytes(collective, b, n)
    if k == 1:
        return ring, 0.0
    return ring * (g - 1) / g, ring / g


def hierarchical_latency(collective: str, g: int, k: int, intra_latency_s: float, inter_latency_s: float) -> float:
    """Latency of one call, growing with the group: a ring pays one step per rank ((g-1) NVLink steps and
    (k-1) network steps per phase, two phases for all_reduce); NCCL's tree all_reduce pays 2·ceil(log2 k)
    network steps instead (the cheaper of the two is taken, as NCCL's tuner does for small messages)."""
    if g * k <= 1 or collective in ("slice", "local", "none"):
        return 0.0
    if collective in ("send_recv", "broadcast"):
        return intra_latency_s if k == 1 else inter_latency_s
    ring = (g - 1) * intra_latency_s + (k - 1) * inter_latency_s
    if collective == "all_reduce":
        tree = 2.0 * ((g - 1) * intra_latency_s + _tree_depth(k) * inter_latency_s)
        return min(2.0 * ring, tree)
    return ring


def hierarchical_seconds(collective: str, b: float, g: int, k: int, intra_latency_s: float, intra_Bps: float,
                         inter_latency_s: float, inter_Bps: float, pxn: bool = False):
    """(seconds, intra-link busy seconds, inter-link busy seconds) of one call: the two links work in a
    pipeline (NCCL channels), so the call takes its latency plus the busier link's time."""
    intra, inter = hierarchical_loads(collective, b, g, k, pxn)
    t_intra, t_inter = intra / intra_Bps, inter / inter_Bps
    return hierarchical_latency(collective, g, k, intra_latency_s, inter_latency_s) + max(t_intra, t_inter), \
        t_intra, t_inter
