"""The value of a one-element distributed tensor, kept on the tensor once every rank has it.

A loss computed from a pipeline's logits lives on the last stage's ranks; the other ranks hold no shard of it
(parallel/pipeline/external_loss.py). Its value reaches every rank at ``loss.backward()`` (one exchange over the
world, every rank walks the same records; the root and the one-element tensors it was computed from) or at an
``item()`` every rank makes, and is kept here, keyed on the tensor: ``item()``, ``float()``, ``numpy()`` and ``format`` of that tensor then read it on this rank alone, with no
collective. ``detach()`` keeps the value (the same data). A change in place drops it: ``rebind`` replaces the
tensor's shards dict (every rank, holding a shard or not), ``fill_`` drops it by name, and a change of a held
shard in place bumps paddle's inplace version, compared here.
"""
from __future__ import annotations

from autoparallel.compat import SideData

_VALUES = SideData()            # DistTensor -> (stamp, python value)


def _stamp(t) -> tuple:
    return t._locals, t._spec, tuple(v._inplace_version() for _, v in sorted(t._locals.items()))


def _same(a: tuple, b: tuple) -> bool:
    return a[0] is b[0] and a[1] is b[1] and a[2] == b[2]


def get(t):
    """The kept value of ``t``, or None (never kept, or changed in place since)."""
    entry = _VALUES.get(t)
    if entry is None:
        return None
    if not _same(entry[0], _stamp(t)):
        _VALUES.pop(t)
        return None
    return entry[1]


def keep(t, value) -> None:
    _VALUES.set(t, (_stamp(t), value))


def drop(t) -> None:
    _VALUES.pop(t)


def copy(src, dst) -> None:
    """``dst`` (``src.detach()``) holds the same value."""
    value = get(src)
    if value is not None:
        keep(dst, value)
