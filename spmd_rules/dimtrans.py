"""Dim transformations of a reshape (like paddle's DimTrans): how each output dim is made of input dims.

* ``InputDim(i)``: output dim is input dim ``i`` unchanged;
* ``Singleton()``: a new size-1 dim;
* ``Flatten(dims)``: the product of consecutive input dims (each an ``InputDim``);
* ``Split(source, shape, index)``: piece ``index`` of ``source`` (an InputDim or Flatten) split into ``shape``.

Sharding passes through a reshape only on the outermost input dim of a group (the first dim of a
Flatten, the source of piece 0 of a Split), and only when every rank's chunk of that input dim is
exactly the chunk of the output dim (with ceil-division chunks this needs e.g. 24 -> [6, 4] over 2 or 3
ranks, but not 20 -> [5, 4] over 3). Anything else must be R.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autoparallel.core.placement import chunk_range


class DimTrans:
    pass


@dataclass(frozen=True)
class InputDim(DimTrans):
    dim: int

    def __str__(self):
        return f"InputDim({self.dim})"


@dataclass(frozen=True)
class Singleton(DimTrans):
    def __str__(self):
        return "Singleton()"


@dataclass(frozen=True)
class Flatten(DimTrans):
    dims: tuple

    def __str__(self):
        return "Flatten(" + ", ".join(map(str, self.dims)) + ")"


@dataclass(frozen=True)
class Split(DimTrans):
    source: DimTrans
    shape: tuple
    index: int

    def __str__(self):
        return f"Split({self.source}, {list(self.shape)}, {self.index})"


def infer_shape(op: str, in_shape, shape) -> tuple:
    """paddle's target-shape conventions: ``-1`` inferred (once), ``0`` copies the input dim."""
    shape = list(shape)
    out = []
    for i, s in enumerate(shape):
        if isinstance(s, bool) or not isinstance(s, int):
            try:
                s = int(s)
            except (TypeError, ValueError):
                raise TypeError(f"{op}: target shape entries must be ints, got {shape!r}") from None
        if s == 0:
            if i >= len(in_shape):
                raise ValueError(f"{op}: 0 at position {i} of {shape} copies an input dim, but x has rank "
                                 f"{len(in_shape)}")
            s = in_shape[i]
        out.append(s)
    if out.count(-1) > 1 or any(s < -1 for s in out):
        raise ValueError(f"{op}: target shape {shape} may contain at most one -1 and no other negatives")
    numel = math.prod(in_shape)
    if -1 in out:
        known = math.prod(s for s in out if s != -1)
        if known == 0 or numel % known:
            raise ValueError(f"{op}: cannot reshape {list(in_shape)} ({numel} elements) into {shape}")
        out[out.index(-1)] = numel // known
    if math.prod(out) != numel:
        raise ValueError(f"{op}: cannot reshape {list(in_shape)} ({numel} elements) into {shape} "
                         f"({math.prod(out)} elements)")
    return tuple(out)


def reshape_transforms(in_shape, out_shape) -> list:
    """One DimTrans per output dim (shapes must have equal element counts, no zero-size dims)."""
    src, tgt = list(in_shape), list(out_shape)
    res: list = [None] * len(tgt)
    i = j = 0
    while i < len(src) or j < len(tgt):
        if j < len(tgt) and tgt[j] == 1 and (i >= len(src) or src[i] != 1):
            res[j] = Singleton()
            j += 1
            continue
        if i < len(src) and src[i] == 1 and (j >= len(tgt) or tgt[j] != 1):
            i += 1
            continue
        if i < len(src) and j < len(tgt) and src[i] == 1 and tgt[j] == 1:
            res[j] = InputDim(i)
            i += 1
            j += 1
            continue
        gi, gj, pi, pj = [i], [j], src[i], tgt[j]
        i += 1
        j += 1
        while pi != pj:
            if pi < pj:
                gi.append(i)
                pi *= src[i]
                i += 1
            else:
                gj.append(j)
                pj *= tgt[j]
                j += 1
        source = InputDim(gi[0]) if len(gi) == 1 else Flatten(tuple(InputDim(d) for d in gi))
        if len(gj) == 1:
            res[gj[0]] = source
        else:
            for n, o in enumerate(gj):
                res[o] = Split(source, tuple(tgt[g] for g in gj), n)
    return res


def carrier(t: DimTrans, in_shape):
    """(input dim whose sharding may pass to this output dim, input inner size, output inner size) or None."""
    if isinstance(t, InputDim):
        return t.dim, 1, 1
    if isinstance(t, Flatten):
        first = t.dims[0].dim
        return first, math.prod(in_shape[d.dim] for d in t.dims[1:]), 1
    if isinstance(t, Split):
        if t.index != 0:
            return None
        inner = carrier(t.source, in_shape)
        if inner is None:
            return None
        return inner[0], inner[1], math.prod(t.shape[1:])
    return None


def aligned(n_in: int, in_inner: int, n_out: int, out_inner: int, k: int) -> bool:
    """Every rank's chunk of the input dim covers the same flat range as its chunk of the output dim."""
    for r in range(k):
        a, b = chunk_range(n_in, k, r)
        c, d = chunk_range(n_out, k, r)
        if (a * in_inner, b * in_inner) != (c * out_inner, d * out_inner):
            return False
    return True


def shard_map(in_shape, out_shape, transforms, k: int) -> dict:
    """{input dim: output dim} for shardings that pass through on a mesh dim of ``k`` ranks."""
    out = {}
    for o, t in enumerate(transforms):
        c = carrier(t, in_shape)
        if c is None:
            continue
        i, in_inner, out_inner = c
        if aligned(in_shape[i], in_inner, out_shape[o], out_inner, k):
            out[i] = o
    return out
