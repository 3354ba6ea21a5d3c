"""Transports: the primitive collectives over one group of ranks, for equal-shaped tensors.

Every function takes ``xs``: {rank: tensor} for the group members this process holds (one in a real
job, all of them in the simulated world) and ``ranks``: the group in mesh order. Shape bookkeeping
(padding uneven shards, trimming) happens one level up, in comm/collectives.py.

The real transport calls ``paddle.distributed`` through the module at call time, so a wrapper around
those functions (comm/counter.py's ``count_comm``) sees every byte sent; ``transport_for`` hands out a
reporting view while ``count_collectives`` is open (the logical collectives, alike in both worlds).
"""
from __future__ import annotations

import paddle

from autoparallel import watchdog
from autoparallel.comm import agreement, collective_log
from autoparallel.comm.capabilities import capabilities
from autoparallel.comm.counter import counted

_LOG_ON = [None]                # AP_COLLECTIVE_LOG, read at the first collective
_REDUCERS = {"sum": lambda a, b: a + b, "max": paddle.maximum, "min": paddle.minimum}


def _reduce_all(ts, op):
    """float16/bfloat16 reduced in float32 and cast back, as the gloo transport does (paddle has no CPU add kernel
    for them, and a real gloo reduction rounds once at the end too); bool in int32 (paddle has no CPU maximum /
    minimum kernel for bool). An integer average keeps the integer dtype (truncated, as the gloo transport's cast
    back does), as paddle's Partial(avg) of an int tensor does."""
    dtype = ts[0].dtype
    carry = "float32" if dtype in (paddle.float16, paddle.bfloat16) else "int32" if dtype == paddle.bool else None
    out = ts[0].astype(carry) if carry else ts[0]
    for t in ts[1:]:
        out = _REDUCERS["sum" if op == "avg" else op](out, t.astype(carry) if carry else t)
    out = out / len(ts) if op == "avg" else out
    return out.astype(dtype) if out.dtype != dtype else out


_COMPLEX = ("complex64", "complex128")
_COMPLEX_DTYPES = (paddle.complex64, paddle.complex128)


def _is_complex(t) -> bool:
    return t is not None and t.dtype in _COMPLEX_DTYPES


def _tree(fn, obj):
    """``fn`` applied to every tensor of a {rank: tensor or [tensors]} payload."""
    if isinstance(obj, dict):
        return {k: _tree(fn, v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_tree(fn, v) for v in obj]
    return fn(obj)


def _has_complex(obj) -> bool:
    if isinstance(obj, dict):
        return any(_has_complex(v) for v in obj.values())
    if isinstance(obj, list):
        return any(_has_complex(v) for v in obj)
    return _is_complex(obj)


def _real_view(t):
    return paddle.as_real(t) if _is_complex(t) else t


def _complex(t):
    return paddle.as_complex(t.contiguous())


def _via_real_views(run, payload, reduction=None):
    """``run(payload)``, a complex payload carried as its real views (gloo has no complex type: "Unknown
    DataType"; NCCL has none either) and every result turned back into complex. ``reduction``: (collective, op) of
    a reducing collective, whose op must be linear for a complex payload."""
    if not _has_complex(payload):
        return run(payload)
    if reduction is not None:
        _complex_op(*reduction)
    return _tree(_complex, run(_tree(_real_view, payload)))


def _complex_op(kind, op) -> None:
    if op not in ("sum", "avg"):
        raise NotImplementedError(f"{kind} with op {op!r} of a complex tensor: complex numbers have no order; "
                                  f"expected 'sum' or 'avg'")


class SimTransport:
    """All members in this process: collectives are computed directly."""

    backend = "sim"

    def all_gather(self, xs, ranks):
        parts = [xs[r] for r in ranks]
        return {r: list(parts) for r in ranks}

    def all_reduce(self, xs, ranks, op):
        total = _reduce_all([xs[r] for r in ranks], op)
        return {r: total.clone() for r in ranks}

    def reduce_scatter(self, xs, ranks, op, axis):
        axis = axis % next(iter(xs.values())).ndim        # a real view adds a last dim
        if _has_complex(xs):     # paddle's CPU split has no complex kernel: the parts travel as real views
            return _via_real_views(lambda v: self.reduce_scatter(v, ranks, op, axis), xs, ("reduce_scatter", op))
        total = _reduce_all([xs[r] for r in ranks], op)
        chunks = paddle.split(total, len(ranks), axis=axis)
        return {r: chunks[k] for k, r in enumerate(ranks)}

    def all_to_all(self, chunks, ranks):
        return {r: [chunks[q][k] for q in ranks] for k, r in enumerate(ranks)}

    def broadcast(self, xs, ranks, src):
        return {r: xs[src].clone() for r in ranks}

    def send_recv(self, xs, pairs, recv_like):
        """``pairs``: [(src_rank, dst_rank)]; returns {dst_rank: tensor}."""
        return {d: xs[s].clone() for s, d in pairs}


class RealTransport:
    """One member per process; paddle.distributed (NCCL on GPUs, gloo on CPUs) does the work.

    Missing capabilities are emulated: reduce_scatter as all_reduce + slice, all_to_all as pairwise
    send/recv in perfect-matching rounds on the group (all_gather for odd groups), AVG as SUM then
    scale, low-precision reductions in float32.
    """

    def __init__(self, rank: int, backend: str):
        self.rank = rank
        self.backend = backend
        self.caps = capabilities(backend)

    @staticmethod
    def _dist():
        import paddle.distributed as dist

        return dist

    def _group(self, ranks):
        from autoparallel.comm.groups import get_group

        return get_group(ranks)

    # every collective is recorded as the operation in flight, so a watchdog can name it if a peer is lost; a
    # complex tensor travels as its real view (_via_real_views)
    def all_gather(self, xs, ranks):
        with watchdog.op("all_gather"):
            self._agree("all_gather", ranks, payload=xs)
            return _via_real_views(lambda v: self._all_gather(v, ranks), xs)

    def all_reduce(self, xs, ranks, op):
        with watchdog.op("all_reduce"):
            self._agree("all_reduce", ranks, payload=xs)
            return _via_real_views(lambda v: self._all_reduce(v, ranks, op), xs, ("all_reduce", op))

    def reduce_scatter(self, xs, ranks, op, axis):
        with watchdog.op("reduce_scatter"):
            self._agree("reduce_scatter", ranks, payload=xs)
            axis = axis % next(iter(xs.values())).ndim        # a real view adds a last dim
            return _via_real_views(lambda v: self._reduce_scatter(v, ranks, op, axis), xs, ("reduce_scatter", op))

    def all_to_all(self, chunks, ranks):
        with watchdog.op("all_to_all"):
            self._agree("all_to_all", ranks, payload={r: c[0] for r, c in chunks.items()})  # one chunk's size
            return _via_real_views(lambda v: self._all_to_all(v, ranks), chunks)

    def broadcast(self, xs, ranks, src):
        with watchdog.op("broadcast"):
            self._agree("broadcast", ranks, payload=xs)
            return _via_real_views(lambda v: self._broadcast(v, ranks, src), xs)

    def send_recv(self, xs, pairs, recv_like):
        with watchdog.op("send_recv"):
            complex_in = {d for d, (_, dtype) in recv_like.items() if str(dtype).split(".")[-1] in _COMPLEX}
            if not complex_in and not _has_complex(xs):
                return self._send_recv(xs, pairs, recv_like)
            like = {d: (list(shape) + [2], "float64" if str(dtype).endswith("128") else "float32") if d in complex_in
                    else (shape, dtype) for d, (shape, dtype) in recv_like.items()}
            got = self._send_recv(_tree(_real_view, xs), pairs, like)
            return {d: _complex(t) if d in complex_in else t for d, t in got.items()}

    def _agree(self, kind, ranks, site=None, payload=None):
        """Every member of ``ranks`` is making this collective, from the same line: noted in the collective log
        (comm/collective_log.py, on by default, nothing sent) and, in the strict mode, agreed before it runs
        (comm/agreement.py)."""
        if payload and list(payload) != [self.rank]:
            raise ValueError(f"a real {kind} on rank {self.rank} was given the locals of ranks {sorted(payload)}: "
                             f"the tensor was made in ap.simulate(world_size=...) and is used outside it; build "
                             f"the model (and its optimizer) in the world it runs in")
        if len(ranks) < 2:
            return
        collective_log.raise_pending()
        if agreement.enabled(self.backend):       # refused on every member: noted on none, the logs stay equal
            self._check(kind, ranks, site)
        if _LOG_ON[0] is None:
            _LOG_ON[0] = collective_log.enabled()
        if _LOG_ON[0]:
            x = next(iter(payload.values())) if payload else None
            collective_log.LOG.note(kind, ranks, None if x is None else (x.shape, x.dtype), depth=2)

    def _check(self, kind, ranks, site):
        gather, group = agreement.raw_all_gather(), self._group(ranks)

        def exchange(record):
            out = []
            gather(out, paddle.to_tensor(record), group=group)
            got = paddle.stack(out).numpy()
            by_rank = dict(zip(self._rank_order(ranks), got))
            return [by_rank[r] for r in ranks]

        agreement.check(exchange, kind, list(ranks), self.rank, site)

    def _rank_order(self, ranks):
        """paddle orders a group's members by global rank; map that order back to mesh order."""
        return sorted(ranks)

    def _all_gather(self, xs, ranks):
        dist = self._dist()
        (x,) = xs.values()
        out = []
        dist.all_gather(out, x.contiguous(), group=self._group(ranks))
        by_rank = dict(zip(self._rank_order(ranks), out))
        return {self.rank: [by_rank[r] for r in ranks]}

    def all_reduce_(self, x, ranks) -> None:
        """Sum ``x`` (this rank's buffer: contiguous, of an exactly reduced dtype) over ``ranks`` in place --
        for buffers the caller owns, such as a fused gradient bucket: no copy in or out."""
        with watchdog.op("all_reduce"):
            self._agree("all_reduce", ranks, payload={self.rank: x})
            dist = self._dist()
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self._group(ranks))

    def start_all_reduce_(self, x, ranks):
        """``all_reduce_`` launched with ``sync_op=False`` (a backend that overlaps: NCCL); returns paddle's task,
        whose ``wait()`` completes it. Noted and agreed like every collective (the watchdog names it meanwhile)."""
        with watchdog.op("all_reduce"):
            self._agree("all_reduce", ranks, payload={self.rank: x})
            dist = self._dist()
            return dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self._group(ranks), sync_op=False)

    def _all_reduce(self, xs, ranks, op):
        dist = self._dist()
        (x,) = xs.values()
        dtype = x.dtype
        name = str(dtype).split(".")[-1]
        y = x.astype("float32") if self.caps.reduce_dtype(name) != name else x.clone()
        y = y.contiguous()
        native = op if self.caps.reduce_natively(op) else ("sum" if op == "avg" else op)
        dist.all_reduce(y, op=_reduce_op(dist, native), group=self._group(ranks))
        if op == "avg" and native == "sum":
            y = y / len(ranks)
        return {self.rank: y.astype(dtype) if y.dtype != dtype else y}

    def _reduce_scatter(self, xs, ranks, op, axis):
        """Native where the backend has reduce_scatter, reduces ``op`` natively and ``x``'s dtype exactly: along
        any axis (dim ``axis`` moved to the front, where paddle splits the parts, and back) and for avg too;
        else all_reduce + slice."""
        (x,) = xs.values()
        k = ranks.index(self.rank)
        name = str(x.dtype).split(".")[-1]
        if self.caps.has("reduce_scatter") and self.caps.reduce_natively(op) and self.caps.reduce_dtype(name) == name:
            dist = self._dist()
            parts = paddle.split(x if axis == 0 else paddle.moveaxis(x, axis, 0), len(ranks), axis=0)
            order = self._rank_order(ranks)
            out = paddle.empty(parts[0].shape, dtype=x.dtype)
            dist.reduce_scatter(out, [parts[ranks.index(r)].contiguous() for r in order], op=_reduce_op(dist, op),
                                group=self._group(ranks))
            return {self.rank: out if axis == 0 else paddle.moveaxis(out, 0, axis).contiguous()}
        total = self._all_reduce(xs, ranks, op)[self.rank]
        return {self.rank: paddle.split(total, len(ranks), axis=axis)[k]}

    def _all_to_all(self, chunks, ranks):
        (mine,) = chunks.values()
        k = ranks.index(self.rank)
        if self.caps.has("all_to_all"):
            dist = self._dist()
            order = self._rank_order(ranks)
            out = []
            dist.alltoall(out, [mine[ranks.index(r)].contiguous() for r in order], group=self._group(ranks))
            by_rank = dict(zip(order, out))
            return {self.rank: [by_rank[r] for r in ranks]}
        if len(ranks) % 2:
            # odd groups have no perfect matching: gather every chunk and keep ours ((n-1)·b bytes)
            got = self._all_gather({self.rank: paddle.stack(mine)}, ranks)[self.rank]
            return {self.rank: [g[k] for g in got]}
        recv = [None] * len(ranks)
        recv[k] = mine[k]
        group = self._group(ranks)
        for matching in round_robin(len(ranks)):       # every member does one send + one recv per round
            for a, b in matching:
                if k not in (a, b):
                    continue
                j = b if k == a else a
                buf = paddle.empty_like(mine[j])        # chunks are padded to one shape
                self._exchange(mine[j].contiguous(), buf, ranks[j], group, send_first=k < j)
                recv[j] = buf
        return {self.rank: recv}

    def _exchange(self, send_t, recv_buf, peer, group, send_first):
        """gloo matches point-to-point messages by a per-group op counter, so both ends must issue
        their send and recv at the same counter: the lower member sends first."""
        dist = self._dist()
        if send_first:
            dist.send(send_t, dst=peer, group=group)
            dist.recv(recv_buf, src=peer, group=group)
        else:
            dist.recv(recv_buf, src=peer, group=group)
            dist.send(send_t, dst=peer, group=group)

    def _broadcast(self, xs, ranks, src):
        dist = self._dist()
        (x,) = xs.values()
        y = x.clone().contiguous()
        dist.broadcast(y, src=src, group=self._group(ranks))
        return {self.rank: y}

    def _send_recv(self, xs, pairs, recv_like):
        dist = self._dist()
        out = {}
        for s, d in pairs:
            if s == d:
                if s == self.rank:
                    out[d] = xs[s].clone()
            elif s == self.rank:                    # a 2-rank group per pair keeps gloo's op counters aligned
                self._agree("send_recv", sorted((s, d)))
                dist.send(xs[s].contiguous(), dst=d, group=self._group(sorted((s, d))))
            elif d == self.rank:
                self._agree("send_recv", sorted((s, d)))
                buf = paddle.empty(recv_like[d][0], dtype=recv_like[d][1])
                dist.recv(buf, src=s, group=self._group(sorted((s, d))))
                out[d] = buf
        return out


def _reduce_op(dist, op: str):
    """paddle's ReduceOp for ``op`` ("sum", "avg", "max", "min")."""
    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
            "avg": getattr(dist.ReduceOp, "AVG", None)}[op]


def round_robin(n: int) -> list:
    """n-1 perfect matchings of n (even) members (circle method): every pair meets exactly once."""
    if n % 2:
        raise ValueError(f"round_robin needs an even number of members, got {n}")
    rounds = []
    for k in range(n - 1):
        pairs = [(k, n - 1)]
        for i in range(1, n // 2):
            pairs.append(((k + i) % (n - 1), (k - i) % (n - 1)))
        rounds.append([tuple(sorted(p)) for p in pairs])
    return rounds


def transport_for(world):
    """This world's transport; while ``count_collectives`` is open, one that reports each call."""
    return counted(SimTransport() if world.is_simulated else RealTransport(world.rank, world.backend))
