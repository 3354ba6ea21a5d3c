"""Count what this rank sends, by wrapping the ``paddle.distributed`` calls themselves.

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

from autoparallel.comm.cost import collective_bytes

_WRAPPED = ("all_gather", "all_reduce", "broadcast", "send", "recv", "reduce_scatter", "alltoall",
            "alltoall_single", "isend", "irecv")


from autoparallel.comm.sizes import nbytes as _nbytes


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
    saved = {}
    owner = threading.get_ident()
    clock = time.perf_counter
    for name in _WRAPPED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

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

        setattr(dist, name, wrapper)
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
