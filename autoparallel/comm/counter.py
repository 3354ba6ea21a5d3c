"""Count what this rank sends, by wrapping the ``paddle.distributed`` calls themselves.

    with count_comm() as log:
        ...
    log.bytes_sent, log.calls   # [(name, bytes this rank sent, group size)]

Bytes follow the ring/pairwise conventions of comm/cost.py applied to each call's real tensor sizes.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from autoparallel.comm.cost import collective_bytes

_WRAPPED = ("all_gather", "all_reduce", "broadcast", "send", "recv", "reduce_scatter", "alltoall",
            "alltoall_single", "isend", "irecv")


def _nbytes(t) -> int:
    return int(t.numel()) * t.element_size()


@dataclass
class CommLog:
    calls: list = field(default_factory=list)

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


def _group_size(group):
    import paddle.distributed as dist

    return group.nranks if group is not None else dist.get_world_size()


def _bytes_for(name, args, kwargs):
    group = kwargs.get("group")
    if group is None:
        # positional group arguments
        pos = {"all_gather": 2, "all_reduce": 2, "broadcast": 2, "send": 2, "recv": 2,
               "reduce_scatter": 3, "alltoall": 2, "isend": 2, "irecv": 2}.get(name)
        if pos is not None and len(args) > pos:
            group = args[pos]
    n = _group_size(group)
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


@contextlib.contextmanager
def count_comm():
    import paddle.distributed as dist

    log = CommLog()
    saved = {}
    for name in _WRAPPED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapper(*args, __fn=fn, __name=name, **kwargs):
            b, n = _bytes_for(__name, args, kwargs)
            log.calls.append((__name, float(b), n))
            return __fn(*args, **kwargs)

        setattr(dist, name, wrapper)
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
