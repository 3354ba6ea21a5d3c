"""Count collectives: the logical ones at the transport (``count_collectives``), the ``paddle.distributed``
calls this rank makes (``count_comm``).

    with count_collectives() as log:          # the simulated world and real ranks alike
        ...
    log.counts(rank=0)                        # {kind: calls} rank 0 takes part in
    log.per_group()                           # {(kind, group): calls}
    log.bytes_sent(rank=0)                    # comm/cost.py's bytes rank 0 sends

The transport (comm/transport.py) reports every collective it runs, with the group's ranks and the bytes
one member holds entering it. A simulated world runs one call for the whole group, a real rank one call
for its own member: ``counts(rank=r)`` in the simulated world is what rank ``r`` counts on a real job.
Collectives outside the transport (the data-parallel buckets' raw calls, pipeline p2p) are not seen here;
``count_comm`` sees those.

``count_comm``: what this rank sends, by wrapping the ``paddle.distributed`` calls themselves.

    with count_comm() as log:
        ...
    log.bytes_sent, log.calls   # [(name, bytes this rank sent, group size)]
    log.seconds, log.held       # per call: wall seconds inside the call, bytes this rank held entering it
    log.groups                  # per call: the group's global ranks (sorted, as paddle orders them)

Bytes follow the ring/pairwise conventions of comm/cost.py applied to each call's real tensor sizes.
``count_comm(observer)`` also tells ``observer.enter_collective(name)`` before and
``observer.leave_collective(name, bytes_sent, group_size, held, ranks)`` after each call made on the
observer's thread (ap.profile's timeline); calls from other threads (a watchdog) are counted, not observed.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

from autoparallel import patches
from autoparallel.comm.cost import collective_bytes
from autoparallel.comm.sizes import nbytes as _nbytes

_WRAPPED = ("all_gather", "all_reduce", "broadcast", "send", "recv", "reduce_scatter", "alltoall",
            "alltoall_single", "isend", "irecv")


@dataclass
class CommLog:
    calls: list = field(default_factory=list)
    seconds: list = field(default_factory=list)
    held: list = field(default_factory=list)
    groups: list = field(default_factory=list)

    @property
    def bytes_sent(self) -> float:
        return sum(b for _, b, _ in self.calls)

    def count(self, name: str | None = None) -> int:
        return sum(1 for c in self.calls if name is None or c[0] == name)

    def summary(self) -> dict:
        out: dict = {}
        for name, b, _ in self.calls:
            n, tot = out.get(name, (0, 0.0))
            out[name] = (n + 1, tot + b)
        return out

    def timing(self) -> dict:
        """{name: (calls, bytes sent, seconds inside the calls)}."""
        out: dict = {}
        for (name, b, _), sec in zip(self.calls, self.seconds):
            n, tot, t = out.get(name, (0, 0.0, 0.0))
            out[name] = (n + 1, tot + b, t + sec)
        return out


def _group_ranks(group) -> tuple:
    import paddle.distributed as dist

    if group is not None:
        return tuple(sorted(group.ranks))
    return tuple(range(dist.get_world_size()))


def _held(name, args, kwargs) -> int:
    """Bytes this rank holds entering the call (comm/cost.py's ``b``)."""
    if name == "all_gather":
        return _nbytes(args[1] if len(args) > 1 else kwargs["tensor"])
    if name in ("reduce_scatter", "alltoall", "alltoall_single"):
        key = "tensor_list" if name == "reduce_scatter" else "in_tensor_list"
        ins = args[1] if len(args) > 1 else kwargs.get(key, kwargs.get("in_tensor"))
        return sum(_nbytes(t) for t in ins) if isinstance(ins, (list, tuple)) else _nbytes(ins)
    t = args[0] if args else kwargs.get("tensor")
    return 0 if t is None else _nbytes(t)


def _group_of(name, args, kwargs):
    group = kwargs.get("group")
    if group is None:
        # positional group arguments
        pos = {"all_gather": 2, "all_reduce": 2, "broadcast": 2, "send": 2, "recv": 2,
               "reduce_scatter": 3, "alltoall": 2, "isend": 2, "irecv": 2}.get(name)
        if pos is not None and len(args) > pos:
            group = args[pos]
    return group


def _bytes_for(name, args, kwargs, n):
    if name == "all_gather":
        return collective_bytes("all_gather", _nbytes(args[1] if len(args) > 1 else kwargs["tensor"]), n), n
    if name == "all_reduce":
        return collective_bytes("all_reduce", _nbytes(args[0] if args else kwargs["tensor"]), n), n
    if name == "broadcast":
        return collective_bytes("broadcast", _nbytes(args[0] if args else kwargs["tensor"]), n), n
    if name in ("send", "isend"):
        return _nbytes(args[0] if args else kwargs["tensor"]), 2
    if name in ("recv", "irecv"):
        return 0, 2
    if name == "reduce_scatter":
        ins = args[1] if len(args) > 1 else kwargs["tensor_list"]
        total = sum(_nbytes(t) for t in ins) if isinstance(ins, (list, tuple)) else _nbytes(ins)
        return collective_bytes("reduce_scatter", total, n), n
    if name in ("alltoall", "alltoall_single"):
        ins = args[1] if len(args) > 1 else kwargs.get("in_tensor_list", kwargs.get("in_tensor"))
        total = sum(_nbytes(t) for t in ins) if isinstance(ins, (list, tuple)) else _nbytes(ins)
        return collective_bytes("all_to_all", total, n), n
    return 0, n


def _pair(name, args, kwargs, ranks) -> tuple:
    """send/recv: the pair (this rank, peer) (``dst``/``src`` are global ranks), so both ends of a message
    name the same group however large the group it travels on."""
    import paddle.distributed as dist

    peer = kwargs.get("dst", kwargs.get("src"))
    if peer is None and len(args) > 1:
        peer = args[1]
    me = dist.get_rank()
    if peer is None or len(ranks) == 2:
        return ranks
    return tuple(sorted((me, int(peer))))


@contextlib.contextmanager
def count_comm(observer=None):
    import paddle.distributed as dist

    log = CommLog()
    saved = {}                                  # name -> our counting wrapper
    owner = threading.get_ident()
    clock = time.perf_counter
    for name in _WRAPPED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrapper(*args, __fn=fn, __name=name, **kwargs):
            ranks = _group_ranks(_group_of(__name, args, kwargs))
            if __name in ("send", "recv", "isend", "irecv"):
                ranks = _pair(__name, args, kwargs, ranks)
            b, n = _bytes_for(__name, args, kwargs, len(ranks))
            held = _held(__name, args, kwargs)
            seen = observer if observer is not None and threading.get_ident() == owner else None
            if seen is not None:
                seen.enter_collective(__name)
            start = clock()
            try:
                return __fn(*args, **kwargs)
            finally:
                sec = clock() - start
                log.calls.append((__name, float(b), n))
                log.seconds.append(sec)
                log.held.append(held)
                log.groups.append(ranks)
                if seen is not None:
                    seen.leave_collective(__name, float(b), n, held, ranks)

        saved[name] = wrapper
    with patches.swapped(dist, saved):           # in the ledger while the block runs
        yield log


# ---- logical collectives, reported by the transport ------------------------------------------------------------
@dataclass(frozen=True)
class Collective:
    """One logical collective: ``kind`` (all_gather, all_reduce, reduce_scatter, all_to_all, broadcast,
    send_recv), ``group`` (the members' global ranks, sorted) and ``nbytes`` (bytes one member holds
    entering it; a send_recv's group is its pair)."""
    kind: str
    group: tuple
    nbytes: int

    @property
    def sent(self) -> float:
        """Bytes one member sends (comm/cost.py's conventions)."""
        return collective_bytes(self.kind, self.nbytes, len(self.group))


@dataclass
class CollectiveLog:
    calls: list = field(default_factory=list)

    def seen_by(self, rank: int | None = None, groups=None) -> list:
        """The calls ``rank`` takes part in (every call for None), on ``groups`` (sorted rank tuples) only."""
        groups = None if groups is None else {tuple(sorted(g)) for g in groups}
        return [c for c in self.calls
                if (rank is None or rank in c.group) and (groups is None or c.group in groups)]

    def counts(self, rank: int | None = None, groups=None) -> dict:
        """{kind: calls} that ``rank`` takes part in (on ``groups``)."""
        out: dict = {}
        for c in self.seen_by(rank, groups):
            out[c.kind] = out.get(c.kind, 0) + 1
        return out

    def per_group(self) -> dict:
        """{(kind, group): calls}."""
        out: dict = {}
        for c in self.calls:
            out[(c.kind, c.group)] = out.get((c.kind, c.group), 0) + 1
        return out

    def bytes_sent(self, rank: int | None = None, groups=None) -> float:
        return sum(c.sent for c in self.seen_by(rank, groups))


_LOGS: list = []          # the open count_collectives logs (every thread's calls are counted)


@contextlib.contextmanager
def count_collectives():
    log = CollectiveLog()
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def counted(transport):
    """``transport`` itself while nothing counts, else a view of it that reports each call."""
    return _Counting(transport) if _LOGS else transport


def _record(kind, ranks, nbytes):
    c = Collective(kind, tuple(sorted(ranks)), int(nbytes))
    for log in list(_LOGS):
        log.calls.append(c)


def _member_bytes(xs) -> int:
    t = next(iter(xs.values()))
    return sum(_nbytes(x) for x in t) if isinstance(t, (list, tuple)) else _nbytes(t)


def _like_bytes(like) -> int:
    import math

    import paddle

    shape, dtype = like
    return math.prod(shape) * paddle.empty([0], dtype=dtype).element_size()


class _Counting:
    """The transport's six calls (and the asynchronous in-place all_reduce of gradient buckets), each reported
    (kind, group, bytes) before it runs."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _holds(self, rank) -> bool:
        """This process holds ``rank``'s member: every rank in the simulated world, its own on a real one."""
        return self.inner.backend == "sim" or self.inner.rank == rank

    def all_gather(self, xs, ranks):
        _record("all_gather", ranks, _member_bytes(xs))
        return self.inner.all_gather(xs, ranks)

    def all_reduce(self, xs, ranks, op):
        _record("all_reduce", ranks, _member_bytes(xs))
        return self.inner.all_reduce(xs, ranks, op)

    def start_all_reduce_(self, x, ranks):
        _record("all_reduce", ranks, _nbytes(x))
        return self.inner.start_all_reduce_(x, ranks)

    def reduce_scatter(self, xs, ranks, op, axis):
        _record("reduce_scatter", ranks, _member_bytes(xs))
        return self.inner.reduce_scatter(xs, ranks, op, axis)

    def all_to_all(self, chunks, ranks):
        _record("all_to_all", ranks, _member_bytes(chunks))
        return self.inner.all_to_all(chunks, ranks)

    def broadcast(self, xs, ranks, src):
        _record("broadcast", ranks, _member_bytes(xs))
        return self.inner.broadcast(xs, ranks, src)

    def send_recv(self, xs, pairs, recv_like):
        """One call per pair that moves data and that this process holds an end of."""
        for s, d in pairs:
            if s != d and (self._holds(s) or self._holds(d)):
                _record("send_recv", (s, d), _nbytes(xs[s]) if s in xs else _like_bytes(recv_like[d]))
        return self.inner.send_recv(xs, pairs, recv_like)
