"""Pipeline schedules as data: for every rank, the ordered list of actions it executes.

An ``Action`` is a forward ``F``, a backward ``B`` (input gradient only when the schedule also has ``W``),
a weight gradient ``W`` (zero-bubble schedules), or one end of a point-to-point transfer
(``SEND_F``/``RECV_F`` carry activations to the next stage, ``SEND_B``/``RECV_B`` carry input gradients
to the previous one). Stages are *virtual* stages: with ``v`` virtual stages per rank there are ``p * v``
of them and virtual stage ``s`` lives on rank ``s % p`` (rank ``r`` holds chunks ``r, r + p, ...``).

For a transfer, ``stage`` is the local end's stage and ``peer`` the remote one's: ``SEND_F(stage=s,
peer=s+1)`` on rank ``s % p`` matches ``RECV_F(stage=s+1, peer=s)`` on rank ``(s + 1) % p``.

Communication placement. The compute order of each rank comes from the published schedule; the
transfers are then placed by one rule: run the compute orders once with unit times, give every
transfer the time its data is produced, and sort each rank's actions by (time, transfers first,
transfer identity). All ranks thus follow one global order, so the lists cannot deadlock even when a
send blocks until its receive is posted (rendezvous, as on gloo), and every pair of ranks sees its
messages in the same order at both ends (FIFO channels need no tags).

Rules on sizes: 1F1B and ZB-H1 need ``micro_batches >= p`` (with fewer, the steady phase is empty;
use FThenB); VPP needs ``vpp >= 2`` and ``micro_batches`` a multiple of ``p`` (micro-batches run in
groups of ``p`` through each chunk, as in Megatron-LM). Violations raise ``ValueError``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

KINDS = ("F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
COMPUTE_KINDS = ("F", "B", "W")
SCHEDULES = ("FThenB", "1F1B", "VPP", "ZB-H1")


@dataclass(frozen=True)
class Action:
    kind: str
    stage: int                       # virtual stage (for a transfer: the local end)
    microbatch: int
    peer: Optional[int] = None       # transfers: virtual stage at the other end
    peer_rank: Optional[int] = None  # transfers: rank at the other end

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Action kind must be one of {KINDS}, got {self.kind!r}")
        if self.is_comm and self.peer is None:
            raise ValueError(f"{self.kind} needs the peer stage, got peer=None")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return not self.is_compute

    @property
    def message(self) -> tuple:
        """Identity of the transferred tensor: (direction, source stage, destination stage, microbatch)."""
        direction = self.kind[-1]
        if self.kind.startswith("SEND"):
            return (direction, self.stage, self.peer, self.microbatch)
        return (direction, self.peer, self.stage, self.microbatch)

    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.kind}{self.microbatch}@s{self.stage}"
        arrow = "->" if self.kind.startswith("SEND") else "<-"
        return f"{self.kind}{self.microbatch}@s{self.stage}{arrow}s{self.peer}"


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists plus the sizes they were made for. Iterates over ranks."""
    name: str
    num_ranks: int
    micro_batches: int
    vpp: int
    actions: tuple                   # tuple (per rank) of tuples of Action

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.vpp

    def rank_of(self, stage: int) -> int:
        return stage % self.num_ranks

    def compute(self, rank: int) -> list:
        return [a for a in self.actions[rank] if a.is_compute]

    def __iter__(self) -> Iterator[tuple]:
        return iter(self.actions)

    def __len__(self) -> int:
        return len(self.actions)

    def __getitem__(self, rank: int) -> tuple:
        return self.actions[rank]

    def __str__(self) -> str:
        head = f"{self.name}: {self.num_ranks} ranks, {self.micro_batches} micro-batches, vpp {self.vpp}"
        rows = [f"rank {r}: " + " ".join(str(a) for a in acts if a.is_compute) for r, acts in enumerate(self)]
        return "\n".join([head] + rows)


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _need_enough_microbatches(name: str, p: int, m: int):
    if m < p:
        raise ValueError(f"{name} needs micro_batches >= pipeline stages, got micro_batches={m} < pp={p}; "
                         f"use more micro-batches or the FThenB schedule")


def _with_communication(name: str, orders: list, p: int, m: int, v: int) -> Schedule:
    """Insert SEND/RECV actions into compute-only orders (see the module docstring for the rule)."""
    from .simulate import simulate     # the simulator needs Action; import here to keep modules acyclic

    has_w = any(a.kind == "W" for order in orders for a in order)
    sim = simulate(orders, forward=1.0, backward=2.0 if not has_w else 1.0, weight=1.0 if has_w else None)
    num_stages = p * v
    keyed = [[((sim.start(a), 1, 0), a) for a in order] for order in orders]
    for order in orders:
        for a in order:
            if a.kind == "F" and a.stage + 1 < num_stages:
                src, dst = a.stage, a.stage + 1
            elif a.kind == "B" and a.stage > 0:
                src, dst = a.stage, a.stage - 1
            else:
                continue
            if src % p == dst % p:
                continue                                   # same rank: the tensor stays local
            key = (sim.end(a), 0, (a.kind, a.microbatch, src))
            keyed[src % p].append((key, Action("SEND_" + a.kind, src, a.microbatch, dst, dst % p)))
            keyed[dst % p].append((key, Action("RECV_" + a.kind, dst, a.microbatch, src, src % p)))
    actions = tuple(tuple(a for _, a in sorted(items, key=lambda item: item[0])) for items in keyed)
    return Schedule(name, p, m, v, actions)


def fthenb(p: int, m: int) -> Schedule:
    """GPipe: every forward, then every backward (peak in-flight micro-batches per stage: m)."""
    _check_int("pp", p), _check_int("micro_batches", m)
    orders = [[Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)] for r in range(p)]
    return _with_communication("FThenB", orders, p, m, 1)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): p-1-r warm-up forwards on rank r, then alternate, then drain backwards."""
    _check_int("pp", p), _check_int("micro_batches", m)
    _need_enough_microbatches("1F1B", p, m)
    orders = []
    for r in range(p):
        warmup = p - 1 - r
        order = [Action("F", r, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action("F", r, warmup + i), Action("B", r, i)]
        order += [Action("B", r, i) for i in range(m - warmup, m)]
        orders.append(order)
    return _with_communication("1F1B", orders, p, m, 1)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): v model chunks per rank, virtual stage
    ``c * p + r`` on rank r. Micro-batches go through each chunk in groups of p."""
    _check_int("pp", p), _check_int("micro_batches", m), _check_int("vpp", v)
    if v < 2:
        raise ValueError(f"VPP needs vpp >= 2 virtual stages per rank, got vpp={v}; use 1F1B for vpp=1")
    if m % p:
        raise ValueError(f"VPP needs micro_batches to be a multiple of pp, got micro_batches={m}, pp={p}")
    total = m * v

    def step(k: int, forward: bool, r: int) -> Action:
        group, within = divmod(k, p * v)
        chunk = within // p if forward else v - 1 - within // p
        return Action("F" if forward else "B", chunk * p + r, group * p + within % p)

    orders = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        order = [step(k, True, r) for k in range(warmup)]
        for k in range(total - warmup):
            order += [step(warmup + k, True, r), step(k, False, r)]
        order += [step(k, False, r) for k in range(total - warmup, total)]
        orders.append(order)
    return _with_communication("VPP", orders, p, m, v)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward is split into B (input
    gradient, on the critical path) and W (weight gradient). Rank r follows 1F1B for F and B and
    postpones its first r weight gradients to the end, where they fill the drain bubble; a micro-batch
    stays live from its F to its W, and at most p are live per rank, as in 1F1B."""
    _check_int("pp", p), _check_int("micro_batches", m)
    _need_enough_microbatches("ZB-H1", p, m)
    orders = []
    for r in range(p):
        warmup = p - 1 - r
        order, w_next = [Action("F", r, i) for i in range(warmup)], 0
        for i in range(m - warmup):
            order += [Action("F", r, warmup + i), Action("B", r, i)]
            if i >= r:
                order.append(Action("W", r, w_next))
                w_next += 1
        for i in range(m - warmup, m):
            order += [Action("B", r, i), Action("W", r, w_next)]
            w_next += 1
        order += [Action("W", r, i) for i in range(w_next, m)]
        orders.append(order)
    return _with_communication("ZB-H1", orders, p, m, 1)


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Schedule by name ("FThenB", "1F1B", "VPP", "ZB-H1"; case-insensitive) for p ranks, m micro-batches
    and v virtual stages per rank (VPP only)."""
    canonical = {s.lower(): s for s in SCHEDULES}.get(str(name).lower())
    if canonical is None:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    _check_int("vpp", v)
    if canonical == "VPP":
        return interleaved_1f1b(p, m, v)
    if v != 1:
        raise ValueError(f"vpp={v} only applies to the VPP schedule, got schedule {canonical!r}")
    return {"FThenB": fthenb, "1F1B": one_f_one_b, "ZB-H1": zb_h1}[canonical](p, m)


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> float:
    """Textbook bubble fraction with equal stage times: (p-1)/(m+p-1), or (p-1)/(v*m+p-1) for VPP.
    ZB-H1 with F = B = W: (p-1)/(3m+p-1)."""
    canonical = {s.lower(): s for s in SCHEDULES}.get(str(name).lower())
    if canonical is None:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    if canonical == "VPP":
        return (p - 1) / (v * m + p - 1)
    if canonical == "ZB-H1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


def as_rank_lists(schedule) -> list:
    """Per-rank lists of actions from a Schedule or any sequence of sequences of Action."""
    ranks = [list(acts) for acts in schedule]
    for r, acts in enumerate(ranks):
        for a in acts:
            if not isinstance(a, Action):
                raise TypeError(f"rank {r}: expected Action items, got {type(a).__name__} {a!r}")
    return ranks


def check_communication(schedule: Sequence) -> None:
    """Every RECV has exactly one matching SEND (and vice versa) between the right ranks, and every
    pair of ranks posts its messages in the same order at both ends. Raises ValueError otherwise."""
    ranks = as_rank_lists(schedule)
    sends, recvs = {}, {}
    stage_rank = {a.stage: r for r, acts in enumerate(ranks) for a in acts if a.is_compute}
    for r, acts in enumerate(ranks):
        for a in acts:
            if a.is_compute:
                continue
            side = sends if a.kind.startswith("SEND") else recvs
            if a.message in side:
                raise ValueError(f"rank {r}: duplicate {a} (message {a.message})")
            peer_rank = a.peer_rank if a.peer_rank is not None else stage_rank.get(a.peer)
            if peer_rank is None:
                raise ValueError(f"rank {r}: {a} names peer stage {a.peer}, which no rank computes")
            side[a.message] = (r, peer_rank, a)
    for msg, (r, peer, a) in recvs.items():
        if msg not in sends:
            raise ValueError(f"rank {r}: {a} has no matching {a.kind.replace('RECV', 'SEND')} on rank {peer}")
    for msg, (r, peer, a) in sends.items():
        if msg not in recvs:
            raise ValueError(f"rank {r}: {a} has no matching {a.kind.replace('SEND', 'RECV')} on rank {peer}")
        if recvs[msg][0] != peer or recvs[msg][1] != r:
            raise ValueError(f"{a} on rank {r} targets rank {peer}, but its receive is on rank {recvs[msg][0]} "
                             f"expecting rank {recvs[msg][1]}")
    channels = {}
    for r, acts in enumerate(ranks):
        for a in acts:
            if a.is_comm:
                src, dst = (r, sends[a.message][1]) if a.kind.startswith("SEND") else (recvs[a.message][1], r)
                channels.setdefault((src, dst), {"SEND": [], "RECV": []})[a.kind[:4]].append(a.message)
    for (src, dst), ch in sorted(channels.items()):
        if ch["SEND"] != ch["RECV"]:
            i = next(k for k, (x, y) in enumerate(zip(ch["SEND"], ch["RECV"])) if x != y)
            raise ValueError(f"rank {src} -> rank {dst}: message #{i} is sent as {ch['SEND'][i]} but received "
                             f"as {ch['RECV'][i]}; both ends must post transfers in the same order")
