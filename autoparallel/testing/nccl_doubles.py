"""The runtime's NCCL branches on gloo ranks: the world says "nccl" and the ``paddle.distributed`` calls gloo
cannot run are replaced by exact doubles, so the code a GPU job runs is called with the arguments it passes.

    with as_nccl() as calls:          # on every rank of a launched gloo job
        y = ap.reshard(x, mesh, [ap.Shard(1)])
    calls["reduce_scatter"]           # native calls the runtime made (the doubles' own traffic is not counted)

The doubles follow paddle's documented semantics (``paddle.distributed.reduce_scatter``, ``alltoall``,
``alltoall_single``, ``all_reduce`` with ``ReduceOp.AVG`` or a float16 / bfloat16 tensor), built from what gloo
runs exactly: all_reduce in float32 (or float64), send / recv, all_gather. An ``all_reduce(sync_op=False)`` runs
when its task is waited for: a result read before ``wait()`` is wrong, as it may be on a GPU.
"""
from __future__ import annotations

import collections
import contextlib

import paddle

_LOW = ("float16", "bfloat16")


class _Done:
    """The task of a call the double completed before returning."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Deferred:
    """The task of a ``sync_op=False`` call: the collective runs when ``wait()`` is called, as late as NCCL may
    finish it (gloo's own ``sync_op=False`` blocks): a reader that does not wait sees the tensor unreduced."""

    def __init__(self, run):
        self._run = run

    def wait(self, *args, **kwargs) -> bool:
        run, self._run = self._run, None
        if run is not None:
            run()
        return True

    def is_completed(self) -> bool:
        return self._run is None


def _name(dtype) -> str:
    return str(dtype).split(".")[-1]


def _members(dist, group) -> list:
    return list(group.ranks) if group is not None else list(range(dist.get_world_size()))


class Doubles:
    """Replacements for ``paddle.distributed``'s functions over the originals ``orig`` (gloo's); ``calls`` counts
    each call the runtime makes, by name (``all_reduce:avg``, ``all_reduce:float16``, ``all_reduce:async``
    too)."""

    def __init__(self, dist):
        self.dist = dist
        self.orig = {n: getattr(dist, n) for n in ("all_reduce", "all_gather", "send", "recv")}
        self.calls: collections.Counter = collections.Counter()

    # ---- helpers over the originals ---------------------------------------------------------------------
    def _sum_like(self, t, op, group):
        """``t`` reduced over ``group`` with ``op`` (a ReduceOp), as a new tensor of ``t``'s dtype: low precision
        carried in float32 (one rounding at the end, as a two-rank NCCL sum), AVG as SUM then divide."""
        dist = self.dist
        avg = op == dist.ReduceOp.AVG
        carry = "float32" if _name(t.dtype) in _LOW else None
        y = (t.astype(carry) if carry else t.clone()).contiguous()
        self.orig["all_reduce"](y, op=dist.ReduceOp.SUM if avg else op, group=group)
        if avg:
            y = y / len(_members(dist, group))
        return y.astype(t.dtype) if y.dtype != t.dtype else y

    def _exchange(self, send_pieces, recv_pieces, group):
        """Member k's ``send_pieces[j]`` lands in member j's ``recv_pieces[k]`` (in place): pairwise send / recv
        in the transport's perfect-matching rounds (gloo matches messages by a per-group counter)."""
        from autoparallel.comm.transport import round_robin

        dist = self.dist
        ranks = _members(dist, group)
        k = ranks.index(dist.get_rank())
        paddle.assign(send_pieces[k], output=recv_pieces[k])
        if len(ranks) % 2:
            raise NotImplementedError(f"the alltoall doubles pair members in perfect matchings: expected an even "
                                      f"group, got {len(ranks)} members")
        for matching in round_robin(len(ranks)):
            for a, b in matching:
                if k not in (a, b):
                    continue
                j = b if k == a else a
                if k < j:
                    self.orig["send"](send_pieces[j].contiguous(), dst=ranks[j], group=group)
                    self.orig["recv"](recv_pieces[j], src=ranks[j], group=group)
                else:
                    self.orig["recv"](recv_pieces[j], src=ranks[j], group=group)
                    self.orig["send"](send_pieces[j].contiguous(), dst=ranks[j], group=group)

    # ---- the doubles ------------------------------------------------------------------------------------
    def all_reduce(self, tensor, op=None, group=None, sync_op=True):
        dist = self.dist
        op = dist.ReduceOp.SUM if op is None else op
        self.calls["all_reduce"] += 1
        if not sync_op:
            self.calls["all_reduce:async"] += 1
        low, avg = _name(tensor.dtype) in _LOW, op == dist.ReduceOp.AVG
        if avg:
            self.calls["all_reduce:avg"] += 1
        if low:
            self.calls[f"all_reduce:{_name(tensor.dtype)}"] += 1
        if not (low or avg):
            run = lambda: self.orig["all_reduce"](tensor, op=op, group=group)          # noqa: E731
        else:
            run = lambda: paddle.assign(self._sum_like(tensor, op, group), output=tensor)  # noqa: E731
        if not sync_op:
            return _Deferred(run)
        run()
        return _Done()

    def reduce_scatter(self, tensor, tensor_list, op=None, group=None, sync_op=True):
        """Member k receives the reduction over the group of every member's ``tensor_list[k]``."""
        dist = self.dist
        op = dist.ReduceOp.SUM if op is None else op
        self.calls["reduce_scatter"] += 1
        ranks = _members(dist, group)
        if len(tensor_list) != len(ranks):
            raise ValueError(f"reduce_scatter expects one tensor per group member ({len(ranks)}), got "
                             f"{len(tensor_list)}")
        if any(list(t.shape) != list(tensor.shape) for t in tensor_list):
            raise ValueError(f"reduce_scatter expects every tensor of tensor_list shaped as the output "
                             f"{list(tensor.shape)}, got {[list(t.shape) for t in tensor_list]}")
        total = self._sum_like(paddle.stack(tensor_list), op, group)
        paddle.assign(total[ranks.index(dist.get_rank())], output=tensor)
        return _Done()

    def alltoall(self, out_tensor_list, in_tensor_list, group=None, sync_op=True):
        """Member k's ``in_tensor_list[j]`` becomes member j's ``out_tensor_list[k]``; an empty
        ``out_tensor_list`` is filled with tensors shaped as the inputs (paddle's dygraph form)."""
        dist = self.dist
        self.calls["alltoall"] += 1
        ranks = _members(dist, group)
        if len(in_tensor_list) != len(ranks):
            raise ValueError(f"alltoall expects one input tensor per group member ({len(ranks)}), got "
                             f"{len(in_tensor_list)}")
        if len(out_tensor_list) == 0:
            out_tensor_list += [paddle.empty_like(t) for t in in_tensor_list]
        self._exchange(list(in_tensor_list), out_tensor_list, group)
        return _Done()

    def alltoall_single(self, out_tensor, in_tensor, in_split_sizes=None, out_split_sizes=None, group=None,
                        sync_op=True):
        """``in_tensor`` split on dim 0 by ``in_split_sizes`` (equal parts when None), part j to member j;
        ``out_tensor`` the parts received, in member order, of ``out_split_sizes`` rows."""
        dist = self.dist
        self.calls["alltoall_single"] += 1
        n = len(_members(dist, group))
        ins = list(in_split_sizes) if in_split_sizes else [in_tensor.shape[0] // n] * n
        outs = list(out_split_sizes) if out_split_sizes else [out_tensor.shape[0] // n] * n
        if sum(ins) != in_tensor.shape[0] or sum(outs) != out_tensor.shape[0] or len(ins) != n or len(outs) != n:
            raise ValueError(f"alltoall_single: split sizes {ins} / {outs} do not cover dim 0 of the input "
                             f"{in_tensor.shape[0]} / output {out_tensor.shape[0]} over {n} members")
        send = paddle.split(in_tensor, ins, axis=0)
        recv = [paddle.empty([s] + list(out_tensor.shape[1:]), dtype=out_tensor.dtype) for s in outs]
        self._exchange(send, recv, group)
        paddle.assign(paddle.concat(recv, axis=0), output=out_tensor)
        return _Done()

    def functions(self) -> dict:
        return {"all_reduce": self.all_reduce, "reduce_scatter": self.reduce_scatter, "alltoall": self.alltoall,
                "alltoall_single": self.alltoall_single}


@contextlib.contextmanager
def gloo_doubles():
    """``paddle.distributed``'s NCCL-only calls replaced by their doubles for a block; yields the call counter."""
    import paddle.distributed as dist

    from autoparallel import patches

    d = Doubles(dist)
    with patches.swapped(dist, d.functions()):
        yield d.calls


@contextlib.contextmanager
def as_nccl(world=None):
    """This real rank's world reports backend "nccl" for a block (its transports take the NCCL branches) and the
    calls gloo cannot run are doubled (``gloo_doubles``); yields the call counter."""
    from autoparallel.comm.world import current_world

    world = world or current_world()
    if world.is_simulated:
        raise ValueError("as_nccl() needs a launched rank: the simulated world has no backend branches")
    old = world.backend
    world.backend = "nccl"
    try:
        with gloo_doubles() as calls:
            yield calls
    finally:
        world.backend = old
