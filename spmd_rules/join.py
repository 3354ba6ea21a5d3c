"""split, chunk, concat, stack: the split/concat axis must be whole; other dims keep their sharding.

split/chunk are linear (a Partial passes to every piece); concat/stack are additive (Partial only when
every operand has the same linear Partial). When operands are sharded differently the largest wins.
split/chunk of a block-sharded axis (``S(a,blocks=..)``) into pieces of whole blocks stay local: a piece of
one block comes out ``S(a)``, of several ``S(a,blocks=..)``; other pieces gather the axis first.
"""
from __future__ import annotations

from autoparallel.core.spec import DistSpec

from spmd_rules.blocks import aligned_pieces, block_aware, piece_placement, unblock
from spmd_rules.einsum import ALL, labels_result
from spmd_rules.result import SpmdResult
from spmd_rules.registry import register_spmd_rule
from spmd_rules.utils import check_spec, norm_axis, promote


def _sections(op, n, num_or_sections):
    if isinstance(num_or_sections, int) and not isinstance(num_or_sections, bool):
        if num_or_sections <= 0 or n % num_or_sections:
            raise ValueError(f"{op}: cannot split a dim of size {n} into {num_or_sections} equal parts")
        return [n // num_or_sections] * num_or_sections
    secs = [int(s) for s in num_or_sections]
    if secs.count(-1) > 1 or any(s < -1 for s in secs):
        raise ValueError(f"{op}: sections {secs} may contain at most one -1")
    if -1 in secs:
        rest = n - sum(s for s in secs if s != -1)
        if rest < 0:
            raise ValueError(f"{op}: sections {secs} exceed the dim size {n}")
        secs[secs.index(-1)] = rest
    if sum(secs) != n:
        raise ValueError(f"{op}: sections {secs} do not add up to the dim size {n}")
    return secs


def _split(op, x, num_or_sections, axis):
    check_spec(op, "x", x)
    if isinstance(axis, DistSpec):
        raise NotImplementedError(f"{op}: an axis given as a tensor is not supported")
    a = norm_axis(op, axis, x.ndim)
    secs = _sections(op, x.shape[a], num_or_sections)
    xl = tuple(None if d == a else d for d in range(x.ndim))
    metas = [(tuple(s if d == a else x.shape[d] for d in range(x.ndim)), x.dtype) for s in secs]
    blocked = _block_split(op, x, a, secs, xl, metas)
    if blocked is not None:
        return blocked
    return labels_result(op, [x], [xl], [xl] * len(secs), metas, linear=ALL)


def _block_split(op, x, a, secs, xl, metas):
    """x block-sharded on the split axis with every piece made of whole blocks: each member splits its
    local rows (no communication); a one-block piece is Shard(a), a several-block piece BlockShard(a)."""
    i = x.block_mesh_dim(a)
    if i is None:
        return None
    p, n = x.placements[i], x.mesh.shape[i]
    bounds = [sum(secs[:k]) for k in range(len(secs) + 1)]
    pieces = aligned_pieces(p.blocks, list(zip(bounds[:-1], bounds[1:])))
    if pieces is None:
        return None                      # not at block boundaries: the label rule gathers the axis first
    base = labels_result(op, [unblock(x)], [xl], [xl] * len(secs), metas, linear=ALL)
    req = base.inputs[0]
    req = req.with_placements(req.placements[:i] + (p,) + req.placements[i + 1:])
    outs = tuple(o.with_placements(o.placements[:i] + (piece_placement(a, b),) + o.placements[i + 1:])
                 for o, b in zip(base.outputs, pieces))
    local = [s // n for s in secs]
    attrs = (lambda coords: {"num_or_sections": local}) if op == "split" else None
    return SpmdResult((req,), outs, None, attrs)


@register_spmd_rule("split")
@block_aware
def split(x, num_or_sections, axis=0, name=None):
    return _split("split", x, num_or_sections, axis)


@register_spmd_rule("chunk")
@block_aware
def chunk(x, chunks, axis=0, name=None):
    if not isinstance(chunks, int) or chunks <= 0:
        raise ValueError(f"chunk: chunks must be a positive int, got {chunks!r}")
    return _split("chunk", x, chunks, axis)


def _operands(op, x):
    if isinstance(x, DistSpec) or not isinstance(x, (list, tuple)) or not x:
        raise TypeError(f"{op}: x must be a non-empty list of DistSpecs, got {type(x).__name__}")
    for i, s in enumerate(x):
        check_spec(op, f"x[{i}]", s)
    return list(x)


@register_spmd_rule("concat")
def concat(x, axis=0, name=None):
    xs = _operands("concat", x)
    nd = xs[0].ndim
    if isinstance(axis, DistSpec):
        raise NotImplementedError("concat: an axis given as a tensor is not supported")
    a = norm_axis("concat", axis, nd)
    for s in xs:
        if s.ndim != nd or any(s.shape[d] != xs[0].shape[d] for d in range(nd) if d != a):
            raise ValueError(f"concat: shapes {[list(s.shape) for s in xs]} differ outside axis {a}")
    # the axis must be whole, unless at most one operand has elements along it (an empty KV cache grown by
    # its first update): then every piece is that operand's, and it may stay split there
    lone = sum(1 for s in xs if s.shape[a]) <= 1
    labels = tuple(None if d == a and not lone else d for d in range(nd))
    shape = tuple(sum(s.shape[a] for s in xs) if d == a else xs[0].shape[d] for d in range(nd))
    return labels_result("concat", xs, [labels] * len(xs), [labels], [(shape, promote(*[s.dtype for s in xs]))],
                         linear="additive")


@register_spmd_rule("stack")
def stack(x, axis=0, name=None):
    xs = _operands("stack", x)
    nd = xs[0].ndim
    a = norm_axis("stack", axis, nd + 1)
    for s in xs:
        if tuple(s.shape) != tuple(xs[0].shape):
            raise ValueError(f"stack: shapes {[list(s.shape) for s in xs]} must all be equal")
    labels = tuple(range(nd))
    out = labels[:a] + (None,) + labels[a:]
    shape = tuple(xs[0].shape[:a]) + (len(xs),) + tuple(xs[0].shape[a:])
    return labels_result("stack", xs, [labels] * len(xs), [out], [(shape, promote(*[s.dtype for s in xs]))],
                         linear="additive")
