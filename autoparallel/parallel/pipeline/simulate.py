"""Discrete-event simulation of pipeline action lists.

Each rank runs its actions in order, one at a time. Compute actions take the given per-stage
durations; an action starts when the rank is free and its inputs exist:

* ``F`` of stage s, micro-batch i needs the activation of stage s-1 (its ``RECV_F`` when the stages are
  on different ranks and the list has one; otherwise ``F`` of s-1, plus ``latency`` across ranks);
* ``B`` of s needs ``F`` of s and the gradient from s+1 (its ``RECV_B``, or ``B`` of s+1);
* ``W`` of s needs ``B`` of s; ``SEND_F`` / ``SEND_B`` need the ``F`` / ``B`` that produced the tensor.

Sends are non-blocking by default (the data arrives ``latency`` after the send is posted; a receive
waits for it). With ``rendezvous=True`` a send also waits until its receive is posted, as a blocking
send does, and both end ``latency`` later. When no action can run while some remain, the simulation
raises ``PipelineDeadlock`` naming the stuck ranks and what each waits for.

Bubble fraction: the share of compute-slot time that ranks sit idle,
``1 - sum(compute time of all ranks) / (ranks * makespan)``, with the makespan measured from the first
compute start to the last compute end. With equal stage times and zero latency this is
(p-1)/(m+p-1) for FThenB and 1F1B and (p-1)/(v*m+p-1) for VPP.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence, Union

from .schedules import Action, as_rank_lists

Durations = Union[float, Sequence[float]]


class PipelineDeadlock(RuntimeError):
    """No rank can make progress although actions remain."""


class Record(NamedTuple):
    """One executed action; the format a runtime uses for measured timelines too."""
    rank: int
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float


def bubble_fraction(records, num_ranks: Optional[int] = None) -> float:
    """Idle share of compute slots from (rank, kind, stage, microbatch, start, end) records.

    Only F/B/W records count as compute. ``num_ranks`` defaults to the number of ranks seen."""
    compute = [Record(*r) for r in records if Record(*r).kind in ("F", "B", "W")]
    if not compute:
        raise ValueError("bubble_fraction needs at least one F/B/W record, got none")
    ranks = num_ranks if num_ranks is not None else len({r.rank for r in compute})
    span = max(r.end for r in compute) - min(r.start for r in compute)
    busy = sum(r.end - r.start for r in compute)
    return 1.0 - busy / (ranks * span) if span > 0 else 0.0


@dataclass
class SimResult:
    num_ranks: int
    num_stages: int
    events: list                      # Record per executed action, comm included, in execution order
    total_time: float                 # makespan of compute
    busy: list                        # compute time per rank
    bubble_fraction: float
    peak_inflight: dict               # stage -> max micro-batches with F done and B not yet
    peak_live: dict                   # stage -> max micro-batches with F done and W (or B) not yet
    peak_inflight_rank: list          # rank -> max (stage, micro-batch) pairs with F done and B not yet,
                                      # summed over the rank's virtual stages
    _times: dict = field(default_factory=dict, repr=False)

    def start(self, action: Action) -> float:
        return self._times[action][0]

    def end(self, action: Action) -> float:
        return self._times[action][1]

    def records(self, include_comm: bool = False) -> list:
        return [e for e in self.events if include_comm or e.kind in ("F", "B", "W")]



def _per_stage(name: str, value, num_stages: int) -> list:
    if isinstance(value, (int, float)):
        values = [float(value)] * num_stages
    else:
        values = [float(x) for x in value]
        if len(values) != num_stages:
            raise ValueError(f"{name} needs one duration per stage ({num_stages}), got {len(values)}")
    if any(x < 0 for x in values):
        raise ValueError(f"{name} durations must be >= 0, got {values}")
    return values


def _validate(ranks: list) -> tuple:
    """Structure checks; returns (stage -> rank, number of stages, whether W actions exist)."""
    stage_rank, seen = {}, {}
    for r, acts in enumerate(ranks):
        for a in acts:
            if not a.is_compute:
                continue
            if stage_rank.setdefault(a.stage, r) != r:
                raise ValueError(f"stage {a.stage} has compute actions on ranks {stage_rank[a.stage]} and {r}")
            key = (a.kind, a.stage, a.microbatch)
            if key in seen:
                raise ValueError(f"rank {r}: {a} appears more than once")
            seen[key] = r
    if not seen:
        raise ValueError("the schedule has no compute actions")
    num_stages = max(stage_rank) + 1
    if sorted(stage_rank) != list(range(num_stages)):
        raise ValueError(f"stages must be 0..{num_stages - 1}, got {sorted(stage_rank)}")
    for kind in ("B", "W"):
        fwd = {(s, i) for k, s, i in seen if k == "F"}
        other = {(s, i) for k, s, i in seen if k == kind}
        if kind == "W" and not other:
            continue
        if fwd != other:
            diff = sorted(fwd ^ other)[:4]
            raise ValueError(f"every forward needs exactly one {kind} and vice versa; mismatched (stage, "
                             f"microbatch): {diff}")
    mbs = {s: {i for k, t, i in seen if k == "F" and t == s} for s in range(num_stages)}
    if any(mbs[s] != mbs[0] for s in mbs):
        raise ValueError("every stage must run the same micro-batches")
    return stage_rank, num_stages, any(k == "W" for k, _, _ in seen)


def simulate(schedule, forward: Durations = 1.0, backward: Durations = 2.0, weight: Optional[Durations] = None,
             latency: float = 0.0, rendezvous: bool = False) -> SimResult:
    """Execute per-rank action lists (a Schedule or lists of Action) and time them.

    ``forward``/``backward``/``weight``: one duration or one per (virtual) stage. In a schedule with W
    actions and ``weight=None``, B and W each take half of ``backward`` (the same total backward work
    as a schedule without W); with ``weight`` given, B takes ``backward`` and W takes ``weight``.
    """
    ranks = as_rank_lists(schedule)
    stage_rank, num_stages, has_w = _validate(ranks)
    if latency < 0:
        raise ValueError(f"latency must be >= 0, got {latency}")
    fwd = _per_stage("forward", forward, num_stages)
    bwd = _per_stage("backward", backward, num_stages)
    wgt = _per_stage("weight", weight, num_stages) if weight is not None else None
    if has_w and wgt is None:
        bwd = [b / 2 for b in bwd]
        wgt = list(bwd)
    duration = {"F": fwd, "B": bwd, "W": wgt}
    recv_of = {a.message: a for acts in ranks for a in acts if a.kind.startswith("RECV")}

    done = {}            # (kind, stage, microbatch) of compute -> end time
    arrived = {}         # message -> arrival time (posted sends)
    received = {}        # message -> time its RECV completed
    times, events = {}, []
    ptr, free = [0] * len(ranks), [0.0] * len(ranks)

    def input_time(direction: str, src: int, dst: int, mb: int):
        msg = (direction, src, dst, mb)
        if msg in recv_of:
            return received.get(msg)
        t = done.get((direction, src, mb))
        if t is None:
            return None
        return t + (latency if stage_rank[src] != stage_rank[dst] else 0.0)

    def ready_time(a: Action):
        s, i = a.stage, a.microbatch
        if a.kind == "F":
            return 0.0 if s == 0 else input_time("F", s - 1, s, i)
        if a.kind == "B":
            f = done.get(("F", s, i))
            if f is None:
                return None
            if s == num_stages - 1:
                return f
            g = input_time("B", s + 1, s, i)
            return None if g is None else max(f, g)
        if a.kind == "W":
            return done.get(("B", s, i))
        if a.kind.startswith("SEND"):
            return done.get((a.kind[-1], s, i))
        return arrived.get(a.message)          # RECV (non-blocking sends)

    def record(r: int, a: Action, start: float, end: float):
        times[a] = (start, end)
        events.append(Record(r, a.kind, a.stage, a.microbatch, start, end))
        free[r] = end
        ptr[r] += 1

    while True:
        progress = False
        for r, acts in enumerate(ranks):
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                if rendezvous and a.kind.startswith("RECV"):
                    break                                  # completed together with its send
                ready = ready_time(a)
                if ready is None:
                    break
                start = max(free[r], ready)
                if a.is_compute:
                    end = start + duration[a.kind][a.stage]
                    done[(a.kind, a.stage, a.microbatch)] = end
                    record(r, a, start, end)
                elif a.kind.startswith("SEND") and not rendezvous:
                    arrived[a.message] = start + latency
                    record(r, a, start, start)
                elif a.kind.startswith("SEND"):
                    recv = recv_of.get(a.message)
                    q = stage_rank.get(a.peer, a.peer_rank)
                    if recv is None or q is None or ptr[q] >= len(ranks[q]) or ranks[q][ptr[q]] != recv:
                        break
                    end = max(start, free[q]) + latency
                    record(r, a, start, end)
                    received[a.message] = end
                    record(q, recv, free[q], end)
                else:                                      # RECV with non-blocking sends
                    end = max(free[r], ready)
                    received[a.message] = end
                    record(r, a, free[r], end)
                progress = True
        if all(ptr[r] == len(acts) for r, acts in enumerate(ranks)):
            break
        if not progress:
            stuck = [f"rank {r} at #{ptr[r]} {acts[ptr[r]]}" for r, acts in enumerate(ranks) if ptr[r] < len(acts)]
            raise PipelineDeadlock("pipeline deadlock: no action can run; stuck: " + "; ".join(stuck))

    compute = [e for e in events if e.kind in ("F", "B", "W")]
    total = max(e.end for e in compute) - min(e.start for e in compute)
    busy = [0.0] * len(ranks)
    for e in compute:
        busy[e.rank] += e.end - e.start
    inflight, live, per_rank = {}, {}, []
    for acts in ranks:
        now_b, now_w, rank_now, rank_peak = {}, {}, 0, 0
        for a in acts:
            rank_now += {"F": 1, "B": -1}.get(a.kind, 0)
            rank_peak = max(rank_peak, rank_now)
            s = a.stage
            if a.kind == "F":
                now_b[s] = now_b.get(s, 0) + 1
                now_w[s] = now_w.get(s, 0) + 1
            elif a.kind == "B":
                now_b[s] -= 1
            if a.kind == ("W" if has_w else "B"):
                now_w[s] -= 1
            inflight[s] = max(inflight.get(s, 0), now_b.get(s, 0))
            live[s] = max(live.get(s, 0), now_w.get(s, 0))
        per_rank.append(rank_peak)
    frac = 1.0 - sum(busy) / (len(ranks) * total) if total > 0 else 0.0
    return SimResult(len(ranks), num_stages, events, total, busy, frac,
                     dict(sorted(inflight.items())), dict(sorted(live.items())), per_rank, times)
