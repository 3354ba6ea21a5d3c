"""Expanding a rule written for ONE mesh dim to an n-d mesh.

A one-dim rule is ``rule_1d(placements, dim) -> (required, outputs)``: ``placements`` holds each input's
placement on one mesh dim (``None`` for an absent optional input), ``dim`` is a ``MeshDim`` (its index and
number of ranks); it returns the required placement of every input and the placement of every output
on that mesh dim. ``expand`` runs it on every mesh dim independently and assembles complete DistSpecs.

Nested sharding (several mesh dims sharding one tensor dim, see autoparallel/spec.py): rules that are
label-based (einsum family, elementwise: an axis is split identically in every operand) declare
``nested=True`` and keep it. For every other rule ``expand`` never lets a second mesh dim shard a tensor
dim that an earlier mesh dim already shards: that mesh dim's input is presented to the rule as R, and if
the rule still wants the claimed dim, the mesh dim falls back to all-R (always correct; the runtime
gathers over the inner mesh dim, which spec.py allows directly).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from autoparallel.core.placement import Placement, Shard
from autoparallel.core.spec import DistSpec

from spmd_rules.utils import R, same_mesh


@dataclass(frozen=True)
class MeshDim:
    index: int
    size: int


def _checked(op, res, n_in, n_out, given):
    if not (isinstance(res, tuple) and len(res) == 2):
        raise TypeError(f"{op}: a one-mesh-dim rule must return (required, outputs), got {res!r}")
    req, outs = tuple(res[0]), tuple(res[1])
    if len(req) != n_in or len(outs) != n_out:
        raise TypeError(f"{op}: a one-mesh-dim rule returned {len(req)} input and {len(outs)} output "
                        f"placements, expected {n_in} and {n_out}")
    for p, g in zip(req, given):
        if (g is None) != (p is None) or (p is not None and not isinstance(p, Placement)):
            raise TypeError(f"{op}: a one-mesh-dim rule returned required placement {p!r} for input {g!r}")
    for p in outs:
        if p is not None and not isinstance(p, Placement):
            raise TypeError(f"{op}: a one-mesh-dim rule returned output placement {p!r}")
    return req, outs


def _clashes(req, outs, claimed_in, claimed_out) -> bool:
    for p, c in list(zip(req, claimed_in)) + list(zip(outs, claimed_out)):
        if isinstance(p, Shard) and p.dim in c:
            return True
    return False


def expand(op: str, inputs: Sequence, out_meta: Sequence, rule_1d: Callable, *, nested: bool = False):
    """Run ``rule_1d`` on every mesh dim; returns (required input specs, output specs).

    ``inputs``: DistSpec or None per input; ``out_meta``: (shape, dtype) or None per output."""
    mesh = same_mesh(op, inputs)
    n_in, n_out = len(inputs), len(out_meta)
    req_pl = [[] for _ in range(n_in)]
    out_pl = [[] for _ in range(n_out)]
    claimed_in = [set() for _ in range(n_in)]
    claimed_out = [set() for _ in range(n_out)]
    for m in range(mesh.ndim):
        dim = MeshDim(m, mesh.shape[m])
        given = tuple(None if s is None else s.placements[m] for s in inputs)
        if not nested:
            given = tuple(R if isinstance(p, Shard) and p.dim in claimed_in[i] else p for i, p in enumerate(given))
        req, outs = _checked(op, rule_1d(given, dim), n_in, n_out, given)
        if not nested and _clashes(req, outs, claimed_in, claimed_out):
            flat = tuple(None if p is None else R for p in given)
            req, outs = _checked(op, rule_1d(flat, dim), n_in, n_out, flat)
            if _clashes(req, outs, claimed_in, claimed_out):
                raise ValueError(f"{op}: cannot place mesh dim {m} without sharding one tensor dim twice")
        for i, p in enumerate(req):
            req_pl[i].append(p)
            if isinstance(p, Shard):
                claimed_in[i].add(p.dim)
        for k, p in enumerate(outs):
            out_pl[k].append(p)
            if isinstance(p, Shard):
                claimed_out[k].add(p.dim)
    required = tuple(None if s is None else DistSpec(mesh, tuple(req_pl[i]), s.shape, s.dtype)
                     for i, s in enumerate(inputs))
    outputs = []
    for k, meta in enumerate(out_meta):
        if meta is None:
            outputs.append(None)
            continue
        shape, dtype = meta
        pl = tuple(R if p is None else p for p in out_pl[k])
        outputs.append(DistSpec(mesh, pl, tuple(shape), dtype))
    return required, tuple(outputs)


def present(specs) -> tuple:
    """The non-None specs, i.e. the DistSpec arguments a rule reports in ``SpmdResult.inputs``."""
    return tuple(s for s in specs if s is not None)


def expand_reverse(op: str, inputs: Sequence, outputs: Sequence, reverse_1d: Callable) -> tuple:
    """Required input specs from wanted output specs, mesh dim by mesh dim.

    ``reverse_1d(output_placements, dim) -> input placements`` (one per input, None-inputs ignored)."""
    for k, o in enumerate(outputs):
        if o is not None and not isinstance(o, DistSpec):
            raise TypeError(f"{op}: wanted output {k} must be a DistSpec, got {type(o).__name__}")
    mesh = same_mesh(op, list(inputs) + list(outputs))
    req_pl = [[] for _ in inputs]
    for m in range(mesh.ndim):
        dim = MeshDim(m, mesh.shape[m])
        outs = tuple(None if o is None else o.placements[m] for o in outputs)
        req = tuple(reverse_1d(outs, dim))
        if len(req) != len(inputs):
            raise TypeError(f"{op}: a reverse one-mesh-dim rule returned {len(req)} placements, expected "
                            f"{len(inputs)}")
        for i, p in enumerate(req):
            req_pl[i].append(R if p is None else p)
    return tuple(None if s is None else DistSpec(mesh, tuple(req_pl[i]), s.shape, s.dtype)
                 for i, s in enumerate(inputs))
