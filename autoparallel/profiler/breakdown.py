"""One rank's step-time breakdown, built from its timeline record; idle waiting split off collectives.

Parts (seconds; they add up to the profiled wall time by construction):

    compute: dispatched ops   the local paddle ops that autoparallel's dispatch runs
    compute: backward         autograd's backward (its kernels; collectives and hooks inside are split off)
    compute: optimizer        the optimizer's update (gradient synchronisation inside is split off)
    compute: other            time outside every hook: plain paddle ops, layers' python, the user's code
    dispatch overhead         dispatch's own work around the local op: rule or plan-cache lookup, layout
                              bookkeeping, argument filling, wrapping outputs into DistTensors
    reshard                   a reshard's local work (slicing, padding, concatenation), its collectives excluded
    comm overhead             the transport's work around a collective (casts, copies, the watchdog's
                              bookkeeping), gradient buckets (packing, unpacking, backward-hook
                              bookkeeping) and the pipeline's point-to-point actions around their messages
    collectives               time inside paddle.distributed calls, minus the waiting below
    idle wait                 time inside a collective spent waiting for peers to arrive
    pipeline bubble           the same waiting inside a pipeline's point-to-point actions

Waiting is measured across ranks when every member of a group reported: the k-th call on a group takes
about as long as the transfer itself on its last-arriving member, so a member's wait is its time minus the
group's fastest time for that call. A call whose group did not all report (one rank's profile alone) is
priced by the cluster's calibrated alpha-beta fit of that collective and group size; the rest is wait.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PARTS = ("compute: dispatched ops", "compute: backward", "compute: optimizer", "compute: other",
         "dispatch overhead", "reshard", "comm overhead", "collectives", "idle wait", "pipeline bubble")

_CATEGORY_PART = {"compute.ops": "compute: dispatched ops", "outside": "compute: other",
                  "dispatch": "dispatch overhead", "reshard": "reshard", "comm.overhead": "comm overhead",
                  "pipeline.p2p": "comm overhead", "grad.sync": "comm overhead",
                  "compute.backward": "compute: backward", "compute.optimizer": "compute: optimizer"}
_FIT_NAME = {"send": "send_recv", "recv": "send_recv", "isend": "send_recv", "irecv": "send_recv",
             "alltoall": "all_to_all", "alltoall_single": "all_to_all"}


@dataclass
class RankBreakdown:
    rank: int
    step_s: float                                  # wall time of the profiled region
    parts: dict                                    # part -> seconds, in PARTS order
    collectives: dict = field(default_factory=dict)   # kind -> {"count", "bytes", "seconds", "wait"}
    counts: dict = field(default_factory=dict)     # "dispatched ops", "reshards", "collectives", "hooked calls"
    hook_s: float = 0.0                            # estimated time the profile's own hooks took (inside the parts)

    def per_op_us(self) -> float:
        """Dispatch overhead per dispatched op (µs)."""
        n = self.counts.get("dispatched ops", 0)
        return self.parts["dispatch overhead"] / n * 1e6 if n else 0.0


def record_of(rank: int, step_s: float, tl) -> dict:
    """A JSON-able record of one rank's timeline (what ranks exchange)."""
    calls = [[c.name, c.bytes_sent, c.group_size, c.held, list(c.ranks), c.seconds, c.context] for c in tl.calls]
    return {"rank": rank, "step_s": step_s, "seconds": dict(tl.seconds), "counts": dict(tl.counts),
            "calls": calls, "simulated": False, "hook_pair_s": tl.hook_pair_s}


def expected_seconds(name: str, held: float, n: int, cluster) -> float:
    """The calibrated transfer time of one call: the cluster's fit of that collective and group size, else
    the alpha-beta model of its link."""
    from autoparallel.comm.cost import collective_seconds

    kind = _FIT_NAME.get(name, name)
    fit = cluster.collective_fit(kind, n)
    if fit is not None:
        return fit.seconds(held)
    link = cluster.intra_node
    try:
        return collective_seconds(kind, held, n, link.latency_s, link.bandwidth_Bps, cluster.backend)
    except KeyError:
        return 0.0


def transfer_times(records: dict, cluster) -> dict:
    """{rank: [transfer seconds of each call]}: the group's fastest member's time for the same call when every
    member reported the same number of calls on that group, else the calibrated estimate (capped at the call)."""
    seq: dict = {}                                  # (group, k) -> [(rank, index, seconds)]
    per_group: dict = {}                            # (rank, group) -> calls so far
    for r, rec in records.items():
        for i, (_, _, _, _, ranks, sec, _) in enumerate(rec["calls"]):
            g = tuple(ranks)
            k = per_group.get((r, g), 0)
            per_group[(r, g)] = k + 1
            seq.setdefault((g, k), []).append((r, i, sec))
    complete = {g for (r, g) in per_group
                if all(per_group.get((m, g)) == per_group[(r, g)] for m in g)}
    out = {r: [None] * len(rec["calls"]) for r, rec in records.items()}
    for (g, _), members in seq.items():
        fastest = min(sec for _, _, sec in members) if g in complete else None
        for r, i, sec in members:
            if fastest is not None and not records[r].get("simulated"):
                out[r][i] = fastest
            else:
                name, _, n, held = records[r]["calls"][i][:4]
                out[r][i] = sec if records[r].get("simulated") else min(sec, expected_seconds(name, held, n, cluster))
    return out


def build(rec: dict, transfers: list) -> RankBreakdown:
    """The breakdown of one rank's record, given the transfer time of each of its calls."""
    parts = dict.fromkeys(PARTS, 0.0)
    for category, sec in rec["seconds"].items():
        if category != "collective":
            parts[_CATEGORY_PART[category]] += sec
    kinds: dict = {}
    wait = bubble = 0.0
    for (name, b, _, _, _, sec, context), transfer in zip(rec["calls"], transfers):
        w = max(0.0, sec - transfer)
        if context == "pipeline.p2p":
            bubble += w
        else:
            wait += w
        k = kinds.setdefault(name, {"count": 0, "bytes": 0.0, "seconds": 0.0, "wait": 0.0})
        k["count"] += 1
        k["bytes"] += b
        k["seconds"] += sec
        k["wait"] += w
    in_calls = rec["seconds"].get("collective", 0.0)
    parts["collectives"] = max(0.0, in_calls - wait - bubble)
    parts["idle wait"], parts["pipeline bubble"] = wait, bubble
    hooked = sum(rec["counts"].values())
    counts = {"dispatched ops": rec["counts"].get("dispatch", 0), "reshards": rec["counts"].get("reshard", 0),
              "collectives": len(rec["calls"]), "pipeline p2p actions": rec["counts"].get("pipeline.p2p", 0),
              "hooked calls": hooked}
    return RankBreakdown(rec["rank"], rec["step_s"], parts, kinds, counts, hooked * rec.get("hook_pair_s", 0.0))


def build_all(records: dict, cluster) -> dict:
    transfers = transfer_times(records, cluster)
    return {r: build(rec, transfers[r]) for r, rec in sorted(records.items())}


def average(runs: list, how: str = "mean") -> dict:
    """{rank: RankBreakdown} over several profiled regions (each a {rank: RankBreakdown} with the same ranks).
    ``how="mean"``: step time, parts, per-kind collective figures, counts and hook time are means;
    ``how="median"``: per rank, the region whose step time is that rank's median (robust to a preempted
    region on a loaded machine). Either way the parts add up to the step time."""
    if how not in ("mean", "median"):
        raise ValueError(f"average(how=...) expects 'mean' or 'median', got {how!r}")
    if not runs:
        raise ValueError("average() needs at least one profiled region")
    ranks = list(runs[0])
    if any(list(run) != ranks for run in runs):
        raise ValueError(f"average() needs the same ranks in every region, got {[sorted(run) for run in runs]}")
    if how == "median":
        return {r: sorted((run[r] for run in runs), key=lambda b: b.step_s)[(len(runs) - 1) // 2] for r in ranks}
    n = len(runs)
    out = {}
    for r in ranks:
        bs = [run[r] for run in runs]
        kinds: dict = {}
        for b in bs:
            for kind, k in b.collectives.items():
                acc = kinds.setdefault(kind, {"count": 0.0, "bytes": 0.0, "seconds": 0.0, "wait": 0.0})
                for key in acc:
                    acc[key] += k[key] / n
        counts = {key: sum(b.counts.get(key, 0) for b in bs) / n for key in bs[0].counts}
        out[r] = RankBreakdown(r, sum(b.step_s for b in bs) / n, {p: sum(b.parts[p] for b in bs) / n for p in PARTS},
                               kinds, counts, sum(b.hook_s for b in bs) / n)
    return out
