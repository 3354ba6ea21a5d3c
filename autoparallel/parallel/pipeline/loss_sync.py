"""The exchanges over the world of a pipeline called without labels, tagged so that a rank-only one fails fast.

Three points make every rank of a launched job exchange over the world (external_loss.py): the start of a call
(before any transfer) and the logits' layout after its forward (``"forward"``), the values of the loss at ``loss.backward()`` (``"backward"``) and a read of the
value of a tensor computed from the logits that no rank has kept yet (``"item"``: ``item()``, ``float()``,
``numpy()``, ``format``). Each is one sum of the same 16 float64 words: four count the ranks making each kind
(and which ranks read), twelve carry the payload. A read made on some ranks only (``if rank == 0:
print(float(loss))`` before ``loss.backward()``, or of ``loss * 2`` made after it) pairs with the other ranks' next
exchange of this kind (at backward, or at the next call), and every
rank sees the counts differ and raises ``LossReadOnSomeRanksError`` naming the ranks, the cause and the fix,
instead of waiting 30 s in gloo and failing without a name (measured before: rank 0 ``TIMEOUT pair_rank = -1``,
the last stage's ranks a failed ``SEND_B``).
"""
from __future__ import annotations

from autoparallel.comm.agreement import CollectiveMismatchError

KINDS = ("item", "backward", "forward")
PAYLOAD = 12
WIDTH = 4 + PAYLOAD                 # [readers, readers' rank bits, backward ranks, forward ranks] + payload
_BITS = 52                          # ranks named exactly in a float64's bits


class LossReadOnSomeRanksError(CollectiveMismatchError):
    """Ranks of a launched job made different exchanges of a pipeline called without labels: a read of the loss's
    value on some ranks only. Raised on every rank (``every_rank_knows``)."""


FIX = ("call float(loss) after loss.backward(), or on every rank (backward keeps the value of the tensor it ran from "
       "and of the one-element tensors that one was computed from, on every rank, and a later read of them is local: "
       "`if rank == 0: print(float(loss))` works after backward; a tensor computed from the loss after backward is "
       "read on every rank)")


def header(kind: str, rank: int) -> list:
    v = [0.0] * 4
    if kind == "item":
        v[0], v[1] = 1.0, float(2 ** rank) if rank < _BITS else 0.0
    else:
        v[1 + KINDS.index(kind)] = 1.0
    return v


def verdict(summed, world_size: int):
    """None when every rank made the same kind of exchange, else the error text."""
    readers, bits, back, fwd = (int(x) for x in summed[:4])
    if world_size in (readers, back, fwd):
        return None
    who = [r for r in range(min(world_size, _BITS)) if (bits >> r) & 1]
    named = f" {who}" if len(who) == readers else ""
    return (f"the value of a tensor computed from a pipeline's logits (float(loss), loss.item(), loss.numpy(), "
            f"f\"{{loss:.4f}}\") was read on {readers} of {world_size} ranks{named} while {back} rank(s) were at "
            f"loss.backward() and {fwd} at the pipeline's next call: a value not kept on the tensor lives on the last "
            f"stage's ranks and reading it is an exchange every rank makes. Fix: {FIX}")


def exchange(kind: str, payload) -> list:
    """The summed payload (``PAYLOAD`` floats) of this exchange over the world; every rank must call it."""
    import paddle
    import paddle.distributed as dist

    from autoparallel.comm.world import current_world

    world = current_world()
    if len(payload) > PAYLOAD:
        raise ValueError(f"an exchange carries {PAYLOAD} values, got {len(payload)}")
    v = header(kind, world.rank) + [float(x) for x in payload] + [0.0] * (PAYLOAD - len(payload))
    t = paddle.to_tensor(v, dtype="float64")
    with paddle.no_grad():
        dist.all_reduce(t)
    out = [float(x) for x in t.numpy()]
    why = verdict(out, world.world_size)
    if why is not None:
        raise LossReadOnSomeRanksError(why)
    return out[4:]
