"""Placements: how one mesh dimension lays out a tensor.

``Shard(d)`` splits tensor dim ``d`` across the mesh dim (ceil-division chunks, later ranks may hold
fewer rows or none), ``Replicate()`` gives every rank the whole tensor, ``Partial(op)`` gives every rank
a term of a pending reduction. Short forms: ``S(0)``, ``R``, ``P(sum)``.

``BlockShard(d, blocks)`` (short form ``S(1,blocks=(64,64))``): dim ``d`` is a concatenation of blocks of
the given sizes (a fused projection's ``[gate | up]`` or ``[q | k | v]``) and EACH block is split evenly over
the mesh dim, so device j holds ``[block0_j | block1_j | ...]`` and a chunk of the fused output into its
blocks stays local. Like torch DTensor's ``_StridedShard``, generalised to unequal blocks.
"""
from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

REDUCE_TYPES = ("sum", "avg", "max", "min")


class ReduceType:
    """paddle's ``ReduceType`` names for ``Partial(reduce_type)`` (``Partial(ap.ReduceType.kRedAvg)``); paddle's
    own enum values are accepted too. kRedProd / kRedAll / kRedAny have no reduction here."""
    kRedSum, kRedAvg, kRedMax, kRedMin = "sum", "avg", "max", "min"


_PADDLE_REDUCE = {"kRedSum": "sum", "kRedAvg": "avg", "kRedMax": "max", "kRedMin": "min"}


def reduce_type_name(value) -> str:
    """``"sum"`` / ``"SUM"`` / ``ReduceType.kRedSum`` (ours or paddle's enum) -> ``"sum"``."""
    if isinstance(value, str):
        low = value.lower()
        return _PADDLE_REDUCE.get(value, low)
    name = getattr(value, "name", None)          # paddle.distributed.ReduceType.kRedSum (a pybind enum)
    if isinstance(name, str) and name.startswith("kRed"):
        if name not in _PADDLE_REDUCE:
            raise NotImplementedError(f"Partial(reduce_type=ReduceType.{name}) is not supported: partial values "
                                      f"reduce by one of {list(_PADDLE_REDUCE)}")
        return _PADDLE_REDUCE[name]
    raise TypeError(f"Partial(reduce_type) expects one of {REDUCE_TYPES} or a ReduceType (kRedSum, kRedAvg, "
                    f"kRedMax, kRedMin), got {type(value).__name__} {value!r}")


class Placement:
    """Base class; concrete placements are frozen dataclasses (hashable, comparable)."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False

    def is_replicated(self) -> bool:
        """paddle's spelling of ``is_replicate``."""
        return self.is_replicate()

    def is_block_shard(self, dim: int | None = None) -> bool:
        return False

    def __repr__(self) -> str:
        return str(self)

    def _eq_foreign(self, other):
        """paddle.distributed's own placement objects compare equal to ours when they mean the same."""
        if isinstance(other, Placement) or not _is_paddle_placement(other):     # ours, of another kind: unequal
            return NotImplemented
        try:
            return self == from_paddle(other)
        except (NotImplementedError, TypeError, ValueError):
            return False


@dataclass(frozen=True, repr=False, init=False)
class Shard(Placement):
    """``Shard(dim)``; a negative ``dim`` counts from the end and becomes non-negative once the tensor's rank is
    known (in its DistSpec), as in paddle. paddle's keyword forms ``split_factor`` and ``shard_order`` are
    refused unless they have their default meaning (see docs/api_call_forms.md)."""
    dim: int

    def __init__(self, dim: int, *, split_factor: int = 1, shard_order=None):
        if isinstance(dim, bool) or not isinstance(dim, int):
            try:
                import numpy as _np
                ok = isinstance(dim, _np.integer)
            except ImportError:          # pragma: no cover
                ok = False
            if not ok:
                raise TypeError(f"Shard(dim) expects an int tensor dim, got {type(dim).__name__} {dim!r}")
            dim = int(dim)
        if split_factor != 1:
            raise NotImplementedError(f"Shard({dim}, split_factor={split_factor!r}) is not supported: a dim made of "
                                      f"equal blocks each split over the mesh dim is BlockShard({dim}, blocks=(b,)*"
                                      f"{split_factor}) with b = size // {split_factor}")
        if shard_order is not None:
            raise NotImplementedError(f"Shard({dim}, shard_order={shard_order!r}) is not supported: mesh dims that "
                                      f"shard one tensor dim nest in mesh-dim order (the lowest mesh dim splits "
                                      f"first); drop shard_order")
        object.__setattr__(self, "dim", dim)

    def __eq__(self, other):
        if other.__class__ is Shard:
            return self.dim == other.dim
        return self._eq_foreign(other)

    def get_dim(self) -> int:
        """paddle's accessor of ``dim``."""
        return self.dim

    def get_split_factor(self) -> int:
        return 1

    def get_co_shard_order(self) -> int:
        return 0

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, repr=False)
class Replicate(Placement):
    def __eq__(self, other):
        if other.__class__ is Replicate:
            return True
        return self._eq_foreign(other)

    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, repr=False)
class Partial(Placement):
    reduce_type: str = "sum"

    def __post_init__(self):
        if not (isinstance(self.reduce_type, str) and self.reduce_type in REDUCE_TYPES):
            object.__setattr__(self, "reduce_type", reduce_type_name(self.reduce_type))
        if self.reduce_type not in REDUCE_TYPES:
            raise ValueError(f"Partial(reduce_type) expects one of {REDUCE_TYPES}, got {self.reduce_type!r}")

    def is_partial(self) -> bool:
        return True

    def __eq__(self, other):
        if other.__class__ is Partial:
            return self.reduce_type == other.reduce_type
        return self._eq_foreign(other)

    def __str__(self) -> str:
        return f"P({self.reduce_type})"


@dataclass(frozen=True, repr=False)
class BlockShard(Placement):
    """Dim ``dim`` = blocks of sizes ``blocks`` laid end to end, each block split evenly over the mesh dim.

    Not a ``Shard``: rank j's rows are not one contiguous range (``is_shard()`` is False, so code that
    handles only contiguous shards never mistakes it for one); ``is_block_shard()`` names it."""
    dim: int
    blocks: tuple

    def __post_init__(self):
        if isinstance(self.dim, numbers.Integral) and not isinstance(self.dim, bool):   # numpy ints as ints
            object.__setattr__(self, "dim", int(self.dim))
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"BlockShard(dim, blocks) expects a non-negative int tensor dim, got {self.dim!r}")
        try:
            blocks = tuple(int(b) for b in self.blocks)
        except (TypeError, ValueError):
            raise TypeError(f"BlockShard blocks must be a sequence of ints, got {self.blocks!r}") from None
        if not blocks or any(b <= 0 for b in blocks) or any(isinstance(b, bool) for b in self.blocks):
            raise ValueError(f"BlockShard blocks must be positive sizes, got {list(self.blocks)}")
        object.__setattr__(self, "blocks", blocks)

    def is_block_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def check(self, extent: int, n: int) -> None:
        """Invariants against the tensor dim's size ``extent`` and the mesh dim's size ``n``."""
        if sum(self.blocks) != extent:
            raise ValueError(f"{self}: blocks sum to {sum(self.blocks)} but tensor dim {self.dim} has size "
                             f"{extent}; the blocks must tile the dim exactly")
        bad = [b for b in self.blocks if b % n]
        if bad:
            raise ValueError(f"{self}: every block must be divisible by the mesh dim size {n}, blocks {bad} "
                             f"are not")

    def local_index(self, n: int, j: int) -> list:
        """Global indices (along ``dim``) held by member ``j`` of ``n``, in local order."""
        out, start = [], 0
        for b in self.blocks:
            c = b // n
            out.extend(range(start + j * c, start + (j + 1) * c))
            start += b
        return out

    def __str__(self) -> str:
        return f"S({self.dim},blocks=({','.join(str(b) for b in self.blocks)}))"


_BLOCK = re.compile(r"^\s*S\(\s*(\d+)\s*,\s*blocks\s*=\s*[\(\[]\s*([\d\s,]*?)\s*,?\s*[\)\]]\s*\)\s*$")
_TOKEN = re.compile(r"^\s*(?:S\(\s*(-?\d+)\s*\)|R|P(?:\(\s*(\w+)\s*\))?)\s*$")


def from_paddle(p) -> Placement:
    """paddle.distributed's own ``Shard`` / ``Replicate`` / ``Partial`` object -> ours (read by its methods)."""
    if p.is_shard():
        split, order = p.get_split_factor(), p.get_co_shard_order()
        return Shard(int(p.get_dim()), split_factor=split, shard_order=None if order == 0 else order)
    if p.is_partial():
        return Partial(reduce_type_name(p.reduce_type()))
    return Replicate()


def _is_paddle_placement(p) -> bool:
    return type(p).__module__.startswith("paddle") and all(hasattr(p, m) for m in ("is_shard", "is_partial"))


def parse_placement(text: str) -> Placement:
    """``"S(0)"`` -> Shard(0), ``"R"`` -> Replicate(), ``"P"``/``"P(sum)"`` -> Partial("sum"); a placement
    object of paddle.distributed (``dist.Shard(0)``) -> the same placement of ours."""
    if isinstance(text, Placement):
        return text
    if _is_paddle_placement(text):
        return from_paddle(text)
    if not isinstance(text, str):
        raise TypeError(f"expected a placement string like 'S(0)', 'R' or 'P(sum)' or a Shard/Replicate/Partial, "
                        f"got {type(text).__name__} {text!r:.60}")
    b = _BLOCK.match(text)
    if b:
        return BlockShard(int(b.group(1)), tuple(int(v) for v in b.group(2).replace(",", " ").split()))
    m = _TOKEN.match(text)
    if not m:
        raise ValueError(f"malformed placement {text!r}: expected 'S(<dim>)', 'S(<dim>,blocks=(<b0>,<b1>,..))', "
                         f"'R' or 'P(<sum|avg|max|min>)'")
    if m.group(1) is not None:
        return Shard(int(m.group(1)))
    if text.strip().startswith("P"):
        return Partial(m.group(2) or "sum")
    return Replicate()


def parse_placements(text) -> tuple[Placement, ...]:
    """``"S(0),R"`` or ``"[S(0), R]"`` or a sequence of strings/placements -> tuple of placements."""
    if isinstance(text, str):
        body = text.strip()
        if body.startswith(("[", "(")) and body.endswith(("]", ")")) and not _TOKEN.match(body):
            body = body[1:-1]
        parts = re.findall(r"S\(\s*\d+\s*,\s*blocks\s*=\s*[\(\[][^\)\]]*[\)\]]\s*\)|S\([^)]*\)|P\([^)]*\)|[^,\s]+",
                           body)
        if not parts:
            raise ValueError(f"malformed placements {text!r}: expected e.g. 'S(0),R'")
        return tuple(parse_placement(p) for p in parts)
    if _is_paddle_placement(text) or isinstance(text, Placement):
        raise TypeError(f"placements are one per mesh dim: pass a list or tuple like [{text!r}], got the single "
                        f"placement {text!r}")
    if isinstance(text, (set, frozenset, dict)):        # no order: which placement is which mesh dim's?
        raise TypeError(f"placements must be a list/tuple in mesh-dim order (one per mesh dim), got the unordered "
                        f"{type(text).__name__} {text!r:.60}")
    try:
        items = list(text)
    except TypeError:
        raise TypeError(f"placements must be a list/tuple of Shard/Replicate/Partial (or a string like 'S(0),R'), "
                        f"got {type(text).__name__} {text!r:.60}") from None
    return tuple(parse_placement(p) for p in items)


def normalize_dims(placements, ndim: int) -> tuple:
    """Negative ``Shard`` dims counted from the end of a rank-``ndim`` tensor (paddle's convention)."""
    if not any(isinstance(p, Shard) and p.dim < 0 for p in placements):
        return tuple(placements)
    out = []
    for p in placements:
        if isinstance(p, Shard) and p.dim < 0:
            if p.dim < -ndim:
                raise ValueError(f"{p} is out of range for a tensor of rank {ndim} (valid dims {-ndim}..{ndim - 1})")
            p = Shard(p.dim + ndim)
        out.append(p)
    return tuple(out)


def format_placements(placements) -> str:
    """Readable form used in plans and tests: ``"(S(0), R)"``."""
    return "(" + ", ".join(str(p) for p in placements) + ")"


def chunk_sizes(n: int, k: int) -> list[int]:
    """Ceil-division chunks of ``n`` items over ``k`` ranks: 7 over 4 -> [2, 2, 2, 1]; 5 over 4 -> [2, 2, 1, 0]."""
    if k <= 0:
        raise ValueError(f"number of chunks must be positive, got {k}")
    c = -(-n // k) if n > 0 else 0
    return [max(0, min(c, n - i * c)) for i in range(k)]


def chunk_range(n: int, k: int, i: int) -> tuple[int, int]:
    """(start, stop) of chunk ``i`` of ``n`` items split over ``k`` with ceil division."""
    c = -(-n // k) if n > 0 else 0
    start = min(n, i * c)
    return start, min(n, start + c)
