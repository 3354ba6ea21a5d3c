"""Binary search of values in a sorted sequence: ``searchsorted(sorted_sequence, values)`` and
``bucketize(x, sorted_sequence)`` (a vision tower finding which image each packed patch belongs to).

A 1-D sorted sequence is gathered (R); the values keep their sharding (each value is searched on its own),
the int32/int64 result is laid out like them. A Partial values tensor is reduced first (the search is not
linear). An N-D sorted sequence (a batch of sequences) gathers everything and replicates the result.
"""
from __future__ import annotations

from autoparallel.core.placement import Partial, Replicate
from autoparallel.core.spec import DistSpec

from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import check_spec


def _rep(s: DistSpec) -> DistSpec:
    return s.with_placements(tuple(Replicate() for _ in s.placements))


def _search(op, seq, values, out_int32):
    check_spec(op, "sorted_sequence", seq)
    check_spec(op, "values", values)
    dtype = "int32" if out_int32 else "int64"
    if seq.ndim > 1:
        if tuple(seq.shape[:-1]) != tuple(values.shape[:-1]):
            raise ValueError(f"{op}: an N-D sorted_sequence {list(seq.shape)} needs values with the same leading "
                             f"dims, got {list(values.shape)}")
        return SpmdResult((_rep(seq), _rep(values)), (DistSpec(values.mesh, _rep(values).placements,
                                                                values.shape, dtype),))
    vals = values.with_placements(tuple(Replicate() if isinstance(p, Partial) else p for p in values.placements))
    return SpmdResult((_rep(seq), vals), (DistSpec(values.mesh, vals.placements, values.shape, dtype),))


@register_spmd_rule("searchsorted")
def searchsorted(sorted_sequence, values, out_int32=False, right=False, name=None, *, side=None, sorter=None):
    """``sorter`` (a permutation sorting the sequence) is gathered with it."""
    if side not in (None, "left", "right"):
        raise ValueError(f"searchsorted: side must be 'left' or 'right', got {side!r}")
    res = _search("searchsorted", sorted_sequence, values, out_int32)
    if sorter is None:
        return res
    check_spec("searchsorted", "sorter", sorter)
    return SpmdResult(res.inputs + (_rep(sorter),), res.outputs)


@register_spmd_rule("bucketize")
def bucketize(x, sorted_sequence, out_int32=False, right=False, name=None):
    res = _search("bucketize", sorted_sequence, x, out_int32)
    return SpmdResult((res.inputs[1], res.inputs[0]), res.outputs)
