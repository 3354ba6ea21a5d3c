"""Communication streams placed on the links they use, and the one budget each link has per step.

Ranks are laid out tp-innermost, then expert/data, then pipeline. A group of n ranks whose members are
``stride`` ranks apart has g = min(n, devices_per_node // stride) members per node (1 when stride >= a node)
on k = n / g nodes. On an NCCL GPU cluster a collective over it runs hierarchically (comm/cost.py:
``hierarchical_seconds``): its bytes split into NVLink bytes and network bytes, each link's busy time is
its bytes over its achieved bandwidth (topology.py), and the call takes its latency (growing with the group)
plus the busier link's time. Other backends (gloo) and calibrated profiles keep the flat alpha-beta price
of the link the group uses (or the measured fit), charged to that link.

The budget (``exposed_overlap``): streams on the critical path (TP, pipeline sends, expert all-to-all)
occupy their links while compute waits. Overlappable streams (ZeRO-3 gathers, DP/ZeRO gradient sync) hide
behind compute only up to what each link carries in the window: per link,

    exposed_L = max(0, fwd_L - overlap·W_fwd) + max(0, bwd_L + sync_L - overlap·W_bwd, sync_L - overlap·W_last)

with W the forward / backward compute of the step (counted once for all streams of the link), W_last the
backward of the last micro-batch (the gradient sync of an accumulated buffer can only start there), and the
step pays max over links of exposed_L (the links run in parallel). So each link's traffic (critical +
overlapped) never exceeds its bandwidth x the step time.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from autoparallel.core.cost import collective_seconds, hierarchical_seconds
from autoparallel.core.topology import topology_of

LINKS = ("nvlink", "network")
_PROBE = float(2 ** 30)


def group_shape(devices_per_node: int, n: int, stride: int):
    """(members per node g, nodes k) of a group of n ranks ``stride`` apart."""
    if n <= 1:
        return 1, 1
    g = 1 if stride >= devices_per_node else max(1, min(n, devices_per_node // stride))
    return g, -(-n // g)


@lru_cache(maxsize=8192)
def _hier(collective, g, k, lat_i, bw_i, lat_n, bw_n, pxn):
    base = hierarchical_seconds(collective, 0.0, g, k, lat_i, bw_i, lat_n, bw_n, pxn)[0]
    _, ti, tn = hierarchical_seconds(collective, _PROBE, g, k, lat_i, bw_i, lat_n, bw_n, pxn)
    return base, ti / _PROBE, tn / _PROBE


@lru_cache(maxsize=8192)
def _flat(collective, n, lat, bw, backend):
    base = collective_seconds(collective, 0.0, n, lat, bw, backend)
    return base, (collective_seconds(collective, _PROBE, n, lat, bw, backend) - base) / _PROBE


def group_affine(cluster, collective: str, n: int, stride: int, pxn: bool = False):
    """(latency s, NVLink s/byte, network s/byte) of one ``collective`` call over the group; seconds of a
    call of b bytes = latency + max(nvlink·b, network·b)."""
    if n <= 1:
        return 0.0, 0.0, 0.0
    g, k = group_shape(cluster.devices_per_node, n, stride)
    fit = cluster.collective_fit(collective, n) if cluster.collectives else None
    flat = fit is not None or cluster.backend != "nccl" or cluster.runtime is not None
    if flat:
        if fit is not None:
            c0, c1 = fit.latency_s, 1.0 / fit.bandwidth_Bps
        else:
            link = cluster.intra_node if k == 1 else cluster.inter_node
            c0, c1 = _flat(collective, n, link.latency_s, link.bandwidth_Bps, cluster.backend)
        return (c0, c1, 0.0) if k == 1 else (c0, 0.0, c1)
    topo = topology_of(cluster)
    bw_i = cluster.intra_node.bandwidth_Bps * topo.nvlink_efficiency
    bw_n = topo.network_Bps(cluster.devices_per_node, k, cluster.inter_node.bandwidth_Bps)
    return _hier(collective, g, k, cluster.intra_node.latency_s, bw_i, cluster.inter_node.latency_s, bw_n,
                 bool(pxn and topo.rail_optimized and k > 1))


@lru_cache(maxsize=64)
def _levels(world: int) -> np.ndarray:
    """Every group size and stride a configuration of ``world`` ranks can have: the divisors of world, and 2."""
    small = [d for d in range(1, int(world ** 0.5) + 1) if world % d == 0]
    return np.array(sorted(set(small + [world // d for d in small] + [2])), dtype=np.int64)


def _factorize(n, stride, world):
    """(unique (n, stride) pairs, index of each candidate's pair) in O(candidates), without sorting them."""
    levels = _levels(world)
    ni = np.minimum(np.searchsorted(levels, n), len(levels) - 1)
    si = np.minimum(np.searchsorted(levels, stride), len(levels) - 1)
    if not (np.array_equal(levels[ni], n) and np.array_equal(levels[si], stride)):
        keys = n.astype(np.int64) * (1 << 32) + stride.astype(np.int64)
        uniq, inverse = np.unique(keys, return_inverse=True)
        return [(int(k >> 32), int(k & 0xFFFFFFFF)) for k in uniq], inverse.reshape(-1)
    key = ni * len(levels) + si
    present = np.flatnonzero(np.bincount(key, minlength=len(levels) ** 2))
    slot = np.zeros(len(levels) ** 2, dtype=np.int64)
    slot[present] = np.arange(len(present))
    pairs = [(int(levels[k // len(levels)]), int(levels[k % len(levels)])) for k in present]
    return pairs, slot[key]


def priced(cluster, collective: str, nbytes, n, stride, pxn: bool = False, cache: dict = None):
    """Per candidate: (seconds, NVLink busy seconds, network busy seconds) of one call of ``nbytes`` bytes
    per rank over groups of ``n`` ranks ``stride`` apart (arrays; each distinct group priced once). ``cache``
    (one evaluation's dict) keeps the grouping of arrays already seen; it holds the arrays, so their ids stay
    theirs while it lives."""
    key = (id(n), id(stride))
    if cache is not None and key in cache:
        pairs, inverse = cache[key][2:]
    else:
        n_arr = np.asarray(n).reshape(-1).astype(np.int64)
        stride_arr = np.broadcast_to(np.asarray(stride).reshape(-1), n_arr.shape).astype(np.int64)
        pairs, inverse = _factorize(n_arr, stride_arr, cluster.world_size)
        if cache is not None:
            cache[key] = (n, stride, pairs, inverse)
    coef = np.array([group_affine(cluster, collective, a, b, pxn) for a, b in pairs]).reshape(-1, 3)
    c0, ci, cn = coef[inverse, 0], coef[inverse, 1], coef[inverse, 2]
    b = np.broadcast_to(np.asarray(nbytes, dtype=float), inverse.shape)
    busy_i, busy_n = ci * b, cn * b
    return c0 + np.maximum(busy_i, busy_n), busy_i, busy_n


class Stream:
    """One communication stream of a step: its time and each link's busy time (arrays, seconds per step)."""

    def __init__(self, seconds, nvlink, network):
        self.seconds, self.nvlink, self.network = seconds, nvlink, network

    @classmethod
    def of(cls, cluster, collective, nbytes, n, stride, calls=1.0, pxn=False, where=True, cache=None):
        sec, bi, bn = priced(cluster, collective, nbytes, n, stride, pxn, cache)
        mask = np.where(where, calls, 0.0)
        return cls(mask * sec, mask * bi, mask * bn)

    def busy(self, link):
        return getattr(self, link)

    def link_seconds(self, link):
        """This stream's time charged to ``link``: its busy time there, plus its latency on the busier link."""
        other = self.network if link == "nvlink" else self.nvlink
        mine = self.busy(link)
        latency = np.maximum(self.seconds - np.maximum(self.nvlink, self.network), 0.0)
        return mine + np.where(mine >= other, latency, 0.0)

    def scaled(self, factor):
        return Stream(self.seconds * factor, self.nvlink * factor, self.network * factor)

    def with_network(self, factor):
        """The same calls with the network bytes scaled by ``factor`` (the latency kept)."""
        latency = np.maximum(self.seconds - np.maximum(self.nvlink, self.network), 0.0)
        network = self.network * factor
        return Stream(latency + np.maximum(self.nvlink, network), self.nvlink, network)

    @staticmethod
    def select(cond, a, b):
        """``a`` where ``cond`` holds, else ``b`` (element-wise, every field)."""
        return Stream(*(np.where(cond, x, y) for x, y in ((a.seconds, b.seconds), (a.nvlink, b.nvlink),
                                                           (a.network, b.network))))

    def __add__(self, other):
        return Stream(self.seconds + other.seconds, self.nvlink + other.nvlink, self.network + other.network)

    @classmethod
    def zero(cls, shape):
        z = np.zeros(shape)
        return cls(z, z, z)


def exposed_overlap(fwd: Stream, bwd: Stream, sync: Stream, w_fwd, w_bwd, w_last, overlap):
    """Seconds the overlappable streams add to the step (max over links of what each link cannot hide)."""
    worst = np.zeros(np.shape(w_fwd))
    for link in LINKS:
        f, b, g = fwd.link_seconds(link), bwd.link_seconds(link), sync.link_seconds(link)
        exposed = (np.maximum(0.0, f - overlap * w_fwd)
                   + np.maximum.reduce([np.zeros_like(b), b + g - overlap * w_bwd, g - overlap * w_last]))
        worst = np.maximum(worst, exposed)
    return worst
