"""Einsum notation for layouts: axis labels decide shardings (like paddle's ShardingMergeForTensors).

Every operand dim carries a label (an axis name) or ``None`` (a dim that must stay whole: a broadcast
size-1 dim, a softmax axis, ...). On one mesh dim:

1. Partial inputs. ``linear`` says in which operands the op is linear: ``"multi"`` (multilinear in each
   operand separately: matmul, einsum, multiply, a reduction, a reshape), a set of operand indices
   (e.g. ``{0}`` for divide's numerator), ``"additive"`` (linear in all operands jointly: add, concat) or
   ``None``. A multilinear op keeps ONE linear Partial (sum/avg): the largest such operand (by element
   count, the first on ties) stays Partial, every other operand is required R, outputs are Partial. An
   additive op keeps Partial only when every operand has the same linear Partial. Everything else
   (P(max), P(min), nonlinear ops) is required R: the runtime reduces first.
2. Shards. Among operands sharded on a labelled dim, the LARGEST operand (by global element count; the
   first on ties) wins: its label becomes the sharded axis, every operand having that label is required
   sharded on it, the others R. An output with the label is sharded on it; an output without it (a
   contracted axis) is ``Partial(reduce)`` (sum for einsum/sum, max/min for those reductions).
3. Otherwise everything is R.

A block-sharded operand (``S(d,blocks=..)``, seen only by rules marked ``block_aware``) competes like a
Shard; when it wins, its label is split block by block in every operand and output (the same rows
everywhere, so the local op is exact; a contracted label gives Partial as for a Shard).

Labels split identically in every operand, so nested sharding (two mesh dims on one axis) is kept.
"""
from __future__ import annotations

import math
import re

from autoparallel.core.placement import BlockShard, Partial, Shard
from autoparallel.core.spec import DistSpec

from spmd_rules.expand import expand, present
from spmd_rules.result import SpmdResult
from spmd_rules.utils import R, is_linear_partial, promote

ALL = "multi"


def _linear_set(linear, n: int) -> list:
    """Operand indices an op is linear in, one at a time (empty for ``None`` and ``"additive"``)."""
    if linear == ALL:
        return list(range(n))
    if isinstance(linear, (set, frozenset, tuple, list)):
        return sorted(linear)
    return []


def _pick(cands, sizes):
    return max(cands, key=lambda i: (sizes[i], -i))


def label_rule(in_labels, out_labels, sizes, *, linear=ALL, reduce: str = "sum"):
    """A one-mesh-dim rule (see expand.py) from operand and output labels.

    ``in_labels``: per operand a tuple of labels/None; ``out_labels``: per output a tuple;
    ``sizes``: per operand its element count (conflict resolution)."""
    in_labels = [tuple(ls) for ls in in_labels]
    out_labels = [tuple(ls) for ls in out_labels]
    n = len(in_labels)
    multi = set(_linear_set(linear, n))

    def rule(pl, dim):
        idx = [i for i in range(n) if pl[i] is not None]
        partial = [i for i in idx if isinstance(pl[i], Partial)]
        if partial:
            if linear == "additive":
                kinds = {pl[i] for i in idx}
                if len(partial) == len(idx) and len(kinds) == 1 and is_linear_partial(pl[idx[0]]):
                    return tuple(pl), tuple(pl[idx[0]] for _ in out_labels)
            else:
                cands = [i for i in partial if i in multi and is_linear_partial(pl[i])]
                if cands:
                    k = _pick(cands, sizes)
                    req = tuple(None if pl[i] is None else (pl[k] if i == k else R) for i in range(n))
                    return req, tuple(pl[k] for _ in out_labels)
        cands = [i for i in idx if isinstance(pl[i], (Shard, BlockShard)) and in_labels[i][pl[i].dim] is not None]
        if not cands:
            return tuple(None if p is None else R for p in pl), tuple(R for _ in out_labels)
        best = _pick(cands, sizes)
        lab = in_labels[best][pl[best].dim]
        blocks = pl[best].blocks if isinstance(pl[best], BlockShard) else None

        def split(d):          # a label splits alike everywhere: plainly, or block by block
            return BlockShard(d, blocks) if blocks else Shard(d)

        req = tuple(None if pl[i] is None else (split(in_labels[i].index(lab)) if lab in in_labels[i] else R)
                    for i in range(n))
        outs = tuple(split(ol.index(lab)) if lab in ol else Partial(reduce) for ol in out_labels)
        return req, outs

    return rule


def label_reverse(in_labels, out_labels, *, linear=ALL, reduce: str = "sum"):
    """The reverse one-mesh-dim rule: wanted output placements -> required input placements."""
    in_labels = [tuple(ls) for ls in in_labels]
    first = tuple(out_labels[0])
    n = len(in_labels)
    multi = _linear_set(linear, n)

    def by_label(lab):
        return tuple(Shard(ls.index(lab)) if lab in ls else R for ls in in_labels)

    def rule(outs, dim):
        p = outs[0]
        if isinstance(p, Shard) and first[p.dim] is not None:
            return by_label(first[p.dim])
        if isinstance(p, Partial):
            if p.reduce_type == reduce:
                contracted = [lab for ls in in_labels for lab in ls if lab is not None and lab not in first]
                if contracted:
                    return by_label(contracted[0])
            if is_linear_partial(p):
                if linear == "additive":
                    return tuple(p for _ in range(n))
                if multi:
                    return tuple(p if i == multi[0] else R for i in range(n))
        return tuple(R for _ in range(n))

    return rule


# ---- einsum equations --------------------------------------------------------------------------------------
_EQ = re.compile(r"^[a-zA-Z.,\->\s]*$")


def parse_equation(op: str, equation: str, shapes) -> tuple:
    """``"bij,bjk->bik"`` and operand shapes -> (operand labels, output labels, output shape).

    Supports ``...`` (right-aligned broadcast dims, size-1 dims broadcast and become ``None``) and
    implicit outputs. A label repeated inside one operand (a diagonal, ``"ii->i"``, ``"bii,bj->bij"``) gets
    ``None`` in every operand and in the output: its dims stay whole everywhere, since the diagonal of a
    shard is not a shard of the diagonal (the local call then takes it: ``diagonal_steps``)."""
    if not isinstance(equation, str) or not _EQ.match(equation):
        raise ValueError(f"{op}: malformed equation {equation!r}")
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise ValueError(f"{op}: equation {equation!r} names {len(terms)} operands, got {len(shapes)}")
    n_ell = 0
    parsed = []
    for t, shape in zip(terms, shapes):
        if t.count("...") > 1 or t.replace("...", "").count(".") or not re.match(r"^[a-zA-Z.]*$", t):
            raise ValueError(f"{op}: malformed operand term {t!r} in {equation!r}")
        letters = t.replace("...", "")
        e = len(shape) - len(letters)
        if e < 0 or (e > 0 and "..." not in t):
            raise ValueError(f"{op}: operand term {t!r} does not match an operand of shape {list(shape)}")
        n_ell = max(n_ell, e)
        parsed.append((t, e))
    # ellipsis sizes (right-aligned broadcast)
    ell_size = [1] * n_ell
    for (t, e), shape in zip(parsed, shapes):
        pos = t.find("...")
        for k in range(e):
            s = shape[pos + k]
            j = n_ell - e + k
            if s != 1:
                if ell_size[j] not in (1, s):
                    raise ValueError(f"{op}: ellipsis dims of {[list(s) for s in shapes]} do not broadcast")
                ell_size[j] = s
    labels, sizes = [], {}
    for (t, e), shape in zip(parsed, shapes):
        ls = []
        d = 0
        i = 0
        while i < len(t):
            if t.startswith("...", i):
                for k in range(e):
                    j = n_ell - e + k
                    ls.append(f"...{j}" if shape[d] == ell_size[j] else None)
                    d += 1
                i += 3
                continue
            c = t[i]
            if c in sizes and sizes[c] != shape[d]:
                raise ValueError(f"{op}: label {c!r} has size {sizes[c]} in one operand and {shape[d]} in "
                                 f"another (shapes {[list(s) for s in shapes]}, equation {equation!r})")
            sizes[c] = shape[d]
            ls.append(c)
            d += 1
            i += 1
        labels.append(tuple(ls))
    for j in range(n_ell):
        sizes[f"...{j}"] = ell_size[j]
    if arrow:
        if rhs.count("...") > 1 or not re.match(r"^[a-zA-Z.]*$", rhs):
            raise ValueError(f"{op}: malformed output term {rhs!r}")
        out = []
        i = 0
        while i < len(rhs):
            if rhs.startswith("...", i):
                out.extend(f"...{j}" for j in range(n_ell))
                i += 3
                continue
            c = rhs[i]
            if c not in sizes:
                raise ValueError(f"{op}: output label {c!r} does not appear in the operands of {equation!r}")
            out.append(c)
            i += 1
        if len(set(out)) != len(out):
            raise ValueError(f"{op}: repeated output label in {equation!r}")
    else:
        counts = {}
        for t, _ in parsed:
            for c in t.replace("...", ""):
                counts[c] = counts.get(c, 0) + 1
        out = [f"...{j}" for j in range(n_ell)] + sorted(c for c, k in counts.items() if k == 1)
    out_shape = tuple(sizes[lab] for lab in out)
    diag = diagonal_labels(eq)
    if diag:
        labels = [tuple(None if lab in diag else lab for lab in ls) for ls in labels]
        out = [None if lab in diag else lab for lab in out]
    return labels, tuple(out), out_shape


def diagonal_labels(equation: str) -> set:
    """The labels repeated inside one operand term of ``equation`` (``"bii,bj->bij"`` -> ``{"i"}``)."""
    lhs = equation.replace(" ", "").partition("->")[0]
    out = set()
    for t in lhs.split(","):
        letters = t.replace("...", "")
        out |= {c for c in letters if letters.count(c) > 1}
    return out


def _implicit_output(terms) -> str:
    """numpy's / paddle's output of an equation without ``->``: ``...`` first, then the labels appearing once in
    the whole equation, sorted (``"ii"`` -> ``""``: a trace)."""
    letters = "".join(t.replace("...", "") for t in terms)
    ell = "..." if any("..." in t for t in terms) else ""
    return ell + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))


def _term_axes(term: str, ndim: int) -> list:
    """The tokens of one operand term (a letter, or ``...`` standing for the broadcast dims) with the axis each
    starts at."""
    width = ndim - len(term.replace("...", ""))
    tokens, axis, i = [], 0, 0
    while i < len(term):
        if term.startswith("...", i):
            tokens.append(("...", axis))
            axis += width
            i += 3
            continue
        tokens.append((term[i], axis))
        axis += 1
        i += 1
    return tokens


def diagonal_steps(equation: str, ndims) -> tuple:
    """How to compute an einsum with repeated labels from one without: ``(steps, equation')`` where each step
    ``(operand, axis1, axis2)`` is a ``paddle.diagonal(operand, 0, axis1, axis2)`` (which puts the diagonal
    last), taken in order, after which ``equation'`` names every label once per operand (an explicit output is
    written for an implicit one). ``"iij->ij"`` on a 3-d operand -> ``([(0, 0, 1)], "ji->ij")``. Both the
    local call of an einsum with diagonals and its check use it (paddle 3.3's own einsum fails on a repeated
    label leading its term: ``"iij->ij"`` raises "The reduce dim index 1 should be in the range")."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        raise ValueError(f"einsum: equation {equation!r} names {len(terms)} operands, got {len(ndims)}")
    rhs = rhs if arrow else _implicit_output(terms)
    steps, new_terms = [], []
    for i, (term, ndim) in enumerate(zip(terms, ndims)):
        tokens = [tok for tok, _ in _term_axes(term, ndim)]
        while any(tok != "..." and tokens.count(tok) > 1 for tok in tokens):
            c = next(tok for tok in tokens if tok != "..." and tokens.count(tok) > 1)
            axes = [a for tok, a in _term_axes("".join(tokens), ndim - len(steps_of(steps, i))) if tok == c][:2]
            steps.append((i, axes[0], axes[1]))
            first = tokens.index(c)
            second = tokens.index(c, first + 1)
            tokens = [tok for k, tok in enumerate(tokens) if k not in (first, second)] + [c]
        new_terms.append("".join(tokens))
    return steps, ",".join(new_terms) + "->" + rhs


def steps_of(steps, operand: int) -> list:
    """The diagonal steps already taken on ``operand`` (each removes one dim)."""
    return [s for s in steps if s[0] == operand]


def labels_result(op: str, specs, in_labels, out_labels, out_metas, *, linear=ALL, reduce: str = "sum",
                  nested: bool = True, local_op=None, local_attrs=None) -> SpmdResult:
    """An SpmdResult from labels (``specs`` may contain None for absent optional operands)."""
    sizes = [0 if s is None else math.prod(s.shape) for s in specs]
    labs = [() if s is None else ls for s, ls in zip(specs, in_labels)]
    rule = label_rule(labs, out_labels, sizes, linear=linear, reduce=reduce)
    required, outputs = expand(op, specs, out_metas, rule, nested=nested)
    return SpmdResult(present(required), outputs, local_op, local_attrs)


def einsum_result(op: str, equation: str, specs, *, out_dtype=None, linear=ALL) -> SpmdResult:
    for i, s in enumerate(specs):
        if not isinstance(s, DistSpec):
            raise TypeError(f"{op}: operand {i} must be a DistSpec, got {type(s).__name__}")
    labels, out, out_shape = parse_equation(op, equation, [s.shape for s in specs])
    dtype = out_dtype or promote(*[s.dtype for s in specs])
    local = "einsum_diagonals" if diagonal_labels(equation) else None      # diagonals taken first, locally
    return labels_result(op, specs, labels, [out], [(out_shape, dtype)], linear=linear, local_op=local)
