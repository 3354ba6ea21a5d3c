"""Stage-to-stage point-to-point transfers over dedicated 2-rank process groups.

paddle 3.3's gloo matches a send with a receive by a per-group operation counter, and any point-to-point
traffic on a group shifts that counter for later collectives on it. So each pair of neighbouring ranks
gets its own group, used for nothing else; all groups are created up front, in one fixed global order on
every rank, each after a barrier (gloo fails when group creation interleaves with other traffic). The
pipeline schedules order every rank's transfers by one global key, so both ends of a pair group issue
their sends and receives in the same order.

A receiver must know the shape and dtype of what it receives. Gradients travelling backward have the
shape of the activation the receiver sent earlier, so they need nothing more. Activations travelling
forward are preceded by a small header (rank, dims, dtype) on the first transfer of each channel in a
step; the later micro-batches of the step reuse it (every micro-batch of a step has the same shape).
"""
from __future__ import annotations

import paddle

from autoparallel.comm.sizes import nbytes

HEADER_LEN = 8                      # [ndim, dtype code, dims... (at most 6)]
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "bool", "uint8", "int8")


def _dist():
    import paddle.distributed as dist          # looked up at call time, so wrappers that count calls see them

    return dist


def dtype_name(t) -> str:
    return str(t.dtype).replace("paddle.", "")


def create_groups(rank_lists) -> list:
    """One paddle Group per list of ranks, created in the given order with a barrier before the first and
    after each; every rank must call this with the same lists (a rank outside a group creates it too)."""
    dist = _dist()
    lists = [list(r) for r in rank_lists]
    for ranks in lists:
        if len(ranks) < 2 or len(set(ranks)) != len(ranks):
            raise ValueError(f"a process group needs at least two distinct ranks, got {ranks}")
    if not lists:
        return []
    from autoparallel.comm.groups import install_group_store_fix

    install_group_store_fix()                # one TCPStore per gloo group (see comm/groups.py)
    dist.barrier()
    groups = []
    for ranks in lists:
        groups.append(dist.new_group(sorted(ranks)))
        dist.barrier()
    return groups


def create_pair_groups(pairs) -> dict:
    """{(a, b): paddle Group} (a < b) for every rank pair, created in the given order (``create_groups``)."""
    pairs = [tuple(sorted(p)) for p in pairs]
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"rank pairs must be distinct, got {pairs}")
    return dict(zip(pairs, create_groups(pairs)))


class P2P:
    """Blocking send / receive between this rank and a peer over their pair group."""

    def __init__(self, rank: int, groups: dict):
        self.rank = rank
        self.groups = dict(groups)
        self.sent_bytes = 0
        self.messages = 0

    def group(self, peer: int):
        key = tuple(sorted((self.rank, peer)))
        if key not in self.groups:
            raise RuntimeError(f"rank {self.rank} has no point-to-point group with rank {peer}; groups exist "
                               f"for {sorted(self.groups)}")
        return self.groups[key]

    def send(self, tensor, peer: int, header: bool = False) -> None:
        t = tensor.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        g = self.group(peer)
        if header:
            _dist().send(encode_header(t), dst=peer, group=g)
        _dist().send(t, dst=peer, group=g)
        self.sent_bytes += nbytes(t)
        self.messages += 1 + int(header)

    def recv(self, peer: int, shape=None, dtype=None):
        """Receive from ``peer``: with ``shape``/``dtype`` given the data alone, otherwise a header first."""
        g = self.group(peer)
        if shape is None:
            h = paddle.zeros([HEADER_LEN], dtype="int64")
            _dist().recv(h, src=peer, group=g)
            shape, dtype = decode_header(h)
        buf = paddle.empty(list(shape), dtype=dtype)
        _dist().recv(buf, src=peer, group=g)
        return buf


def encode_header(t) -> paddle.Tensor:
    shape = list(t.shape)
    name = dtype_name(t)
    if len(shape) > HEADER_LEN - 2:
        raise ValueError(f"point-to-point transfers carry tensors of at most {HEADER_LEN - 2} dims, got "
                         f"shape {shape}")
    if name not in DTYPES:
        raise ValueError(f"point-to-point transfers carry dtypes {DTYPES}, got {name}")
    values = [len(shape), DTYPES.index(name)] + shape + [0] * (HEADER_LEN - 2 - len(shape))
    return paddle.to_tensor(values, dtype="int64")


def decode_header(h) -> tuple:
    values = [int(v) for v in h.numpy().tolist()]
    ndim, code = values[0], values[1]
    if not 0 <= ndim <= HEADER_LEN - 2 or not 0 <= code < len(DTYPES):
        raise RuntimeError(f"corrupt point-to-point header {values}: the two ends disagree on the message order")
    return values[2:2 + ndim], DTYPES[code]


# ---- transports used by the runtime: the same calls in one process and across ranks ----------------------
class LocalTransport:
    """Every stage in this process: a transfer is a hand-off through a mailbox keyed by the message."""

    def __init__(self):
        self.box = {}

    def ready(self, action) -> bool:
        return not action.kind.startswith("RECV") or action.message in self.box

    def send(self, action, tensor, header: bool = False) -> None:
        self.box[action.message] = tensor.detach()

    def recv(self, action, shape=None, dtype=None):
        return self.box.pop(action.message)

    def pending(self) -> int:
        return len(self.box)

    def reset(self) -> None:
        """Drop what a failed step left in the mailbox (a later step must not receive it)."""
        self.box.clear()


class RankTransport:
    """One pipeline rank per process: a transfer goes over the pair group to the peer stage's rank with
    this rank's data / model coordinates. ``global_rank(pp_rank)`` maps a pipeline rank to that rank."""

    def __init__(self, p2p: P2P, global_rank):
        self.p2p = p2p
        self.global_rank = global_rank

    def ready(self, action) -> bool:
        return True

    def send(self, action, tensor, header: bool = False) -> None:
        self.p2p.send(tensor, self.global_rank(action.peer_rank), header)

    def recv(self, action, shape=None, dtype=None):
        return self.p2p.recv(self.global_rank(action.peer_rank), shape, dtype)

    def pending(self) -> int:
        return 0

    def reset(self) -> None:
        """Nothing to drop here: a transfer of a failed step may still be on its way to or from a peer, which is
        why a failed step stops the pipeline on real ranks (``PipelineModule.failed``)."""
