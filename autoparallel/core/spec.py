"""DistSpec: (mesh, placements, global shape, dtype) — hashable, the cache key everywhere.

Several mesh dims may shard the same tensor dim: they split it in mesh-dim order (nested, like torch
DTensor): the lowest mesh dim splits the global extent with ceil division, the next splits that chunk,
and so on. Only the innermost (highest) mesh dim of such a nest can gather or slice directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autoparallel.core.hashing import HashedOnce
from autoparallel.core.mesh import ProcessMesh
from autoparallel.core.placement import (BlockShard, Partial, Placement, Replicate, Shard, _is_paddle_placement,
                                         chunk_range, normalize_dims, parse_placements)

_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
                "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}


# (type, dtype) -> canonical name, filled as dtypes are seen; keyed by type too because paddle's enums
# compare equal across enum types by value (VarType.FP32 == DataType.INT16)
_NORMALIZED: dict = {}


def normalize_dtype(dtype) -> str:
    """'float32', paddle.float32, np.float32 -> 'float32'."""
    key = (dtype.__class__, dtype)
    try:
        return _NORMALIZED[key]
    except (KeyError, TypeError):
        pass
    s = _normalize(dtype)
    try:
        _NORMALIZED[key] = s
    except TypeError:                   # unhashable: not remembered
        pass
    return s


def _normalize(dtype) -> str:
    s = str(dtype)
    for prefix in ("paddle.", "VarType.", "DataType."):
        if s.startswith(prefix):
            s = s[len(prefix):]
    s = s.lower()
    s = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}.get(s, s)
    if s.startswith("<class 'numpy."):
        s = s[len("<class 'numpy."):-2]
    if s not in _DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}: expected one of {sorted(_DTYPE_BYTES)}")
    return s


def dtype_bytes(dtype) -> int:
    return _DTYPE_BYTES[normalize_dtype(dtype)]


_WITH_PLACEMENTS: dict = {}     # (spec, placements) -> spec: layouts derived again and again (gradients, reshards)


def input_shape_dtype(x, what: str) -> tuple[tuple[int, ...], object]:
    """(fully known shape, dtype or None) of one input description: a DistSpec, an InputSpec or (shape, dtype)."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None and isinstance(x, (tuple, list)) and len(x) == 2:
        shape, dtype = x
    if shape is None or any(s is None or int(s) < 0 for s in shape):
        raise ValueError(f"{what}: expected a DistSpec, an InputSpec or (shape, dtype) with a fully known "
                         f"shape, got {x!r}")
    return tuple(int(s) for s in shape), dtype


def check_placements(mesh: ProcessMesh, placements, ndim: int) -> tuple[Placement, ...]:
    """Validate placements against a mesh and a tensor rank; returns them as a tuple.

    A list of Placement objects shorter than the mesh is padded with Replicate() on the remaining mesh dims,
    as paddle does (``[Shard(1)]`` on a 2-D mesh is ``[Shard(1), Replicate()]``); the string notation
    (``"S(0),R"``) names every mesh dim."""
    text = isinstance(placements, str) or any(isinstance(p, str) for p in placements)
    pl = parse_placements(placements) if not isinstance(placements, tuple) or text else placements
    for p in pl:
        if not isinstance(p, Placement):
            if _is_paddle_placement(p):          # paddle.distributed's own Shard/Replicate/Partial
                pl = parse_placements(pl)
                break
            raise TypeError(f"placements must be Shard/Replicate/Partial, got {type(p).__name__} {p!r}")
    pl = normalize_dims(pl, ndim)
    if not text and len(pl) < mesh.ndim:
        pl = tuple(pl) + (Replicate(),) * (mesh.ndim - len(pl))
    if len(pl) != mesh.ndim:
        pad = "" if text else " (a shorter list of Placement objects is padded with Replicate())"
        raise ValueError(f"expected {mesh.ndim} placements (one per mesh dim of {mesh.shape}), got {len(pl)}: "
                         f"{[str(p) for p in pl]}{pad}")
    for p in pl:
        if isinstance(p, Shard) and not p.dim < ndim:
            raise ValueError(f"{p} is out of range for a tensor of rank {ndim} (valid dims 0..{ndim - 1})")
    for p in pl:
        if isinstance(p, BlockShard) and not p.dim < ndim:
            raise ValueError(f"{p} is out of range for a tensor of rank {ndim} (valid dims 0..{ndim - 1})")
    return tuple(pl)


def check_block_shards(mesh: ProcessMesh, placements, shape) -> None:
    """A BlockShard's blocks tile its dim, divide by the mesh dim size, and no other mesh dim splits that dim."""
    for i, p in enumerate(placements):
        if isinstance(p, BlockShard):
            p.check(shape[p.dim], mesh.shape[i])
            other = [j for j, q in enumerate(placements) if j != i and (q.is_shard(p.dim) or q.is_block_shard(p.dim))]
            if other:
                raise ValueError(f"{p} on mesh dim {i} cannot be nested with {placements[other[0]]} on mesh dim "
                                 f"{other[0]}: a block-sharded tensor dim is split by one mesh dim only")


@dataclass(frozen=True)
class DistSpec(HashedOnce):
    mesh: ProcessMesh
    placements: tuple
    shape: tuple
    dtype: str = "float32"

    def __post_init__(self):
        shape = tuple(int(s) for s in self.shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"global shape must be non-negative, got {list(shape)}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "placements", check_placements(self.mesh, self.placements, len(shape)))
        if any(isinstance(p, BlockShard) for p in self.placements):
            check_block_shards(self.mesh, self.placements, shape)
        self._rehash()

    # ---- identity (specs key every cache: hash once, compare cheaply) -------------------------
    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._hash == other._hash and self.shape == other.shape and self.dtype == other.dtype \
            and self.placements == other.placements and self.mesh == other.mesh

    def _hash_key(self):
        return self.mesh, self.placements, self.shape, self.dtype

    # ---- derived facts ------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)

    def shard_mesh_dims(self, tensor_dim: int) -> list[int]:
        """Mesh dims sharding ``tensor_dim``, outermost first."""
        return [i for i, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == tensor_dim]

    def partial_mesh_dims(self) -> list[int]:
        return [i for i, p in enumerate(self.placements) if isinstance(p, Partial)]

    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def block_mesh_dim(self, tensor_dim: int):
        """The mesh dim block-sharding ``tensor_dim`` (a BlockShard), or None."""
        for i, p in enumerate(self.placements):
            if isinstance(p, BlockShard) and p.dim == tensor_dim:
                return i
        return None

    def local_index(self, coords: Sequence[int], tensor_dim: int):
        """This rank's rows of ``tensor_dim``: a ``slice`` (contiguous shards) or a list of global indices
        (a block-sharded dim, see placement.BlockShard)."""
        i = self.block_mesh_dim(tensor_dim)
        if i is None:
            return slice(*self.local_range(coords, tensor_dim))
        return self.placements[i].local_index(self.mesh.shape[i], coords[i])

    def local_extent(self, coords: Sequence[int], tensor_dim: int) -> int:
        i = self.block_mesh_dim(tensor_dim)
        if i is not None:
            return self.shape[tensor_dim] // self.mesh.shape[i]
        a, b = self.local_range(coords, tensor_dim)
        return b - a

    def local_range(self, coords: Sequence[int], tensor_dim: int) -> tuple[int, int]:
        """[start, stop) of this rank's slice of ``tensor_dim`` in global indices."""
        if self.block_mesh_dim(tensor_dim) is not None:
            raise ValueError(f"tensor dim {tensor_dim} of {self} is block-sharded: its local rows are not one "
                             f"contiguous range (use local_index)")
        start, stop = 0, self.shape[tensor_dim]
        for i in self.shard_mesh_dims(tensor_dim):
            a, b = chunk_range(stop - start, self.mesh.shape[i], coords[i])
            start, stop = start + a, start + b
        return start, stop

    def local_slices(self, coords: Sequence[int]) -> tuple:
        """Index of this rank's shard in the global array: slices, and for a block-sharded dim a numpy
        index array (one advanced index: ``full[sl]`` keeps every dim in place)."""
        return tuple(np.asarray(ix) if isinstance(ix, list) else ix
                     for ix in (self.local_index(coords, d) for d in range(self.ndim)))

    def local_shape(self, coords_or_rank) -> tuple[int, ...]:
        coords = self.mesh.coords_of(coords_or_rank) if isinstance(coords_or_rank, (int, np.integer)) else coords_or_rank
        return tuple(self.local_extent(coords, d) for d in range(self.ndim))

    def max_local_shape(self) -> tuple[int, ...]:
        """Chunk (padded) shape: the largest local shard on any rank."""
        out = list(self.shape)
        for d in range(self.ndim):
            for i in self.shard_mesh_dims(d):
                k = self.mesh.shape[i]
                out[d] = -(-out[d] // k) if out[d] else 0
            b = self.block_mesh_dim(d)
            if b is not None:
                out[d] //= self.mesh.shape[b]
        return tuple(out)

    def local_nbytes(self) -> int:
        return int(np.prod(self.max_local_shape())) * dtype_bytes(self.dtype) if self.ndim else dtype_bytes(self.dtype)

    def with_placements(self, placements) -> "DistSpec":
        placements = tuple(placements)
        key = (self, placements)
        try:
            return _WITH_PLACEMENTS[key]
        except KeyError:
            pass
        except TypeError:                    # unhashable items: validated (and rejected) below
            return DistSpec(self.mesh, placements, self.shape, self.dtype)
        spec = DistSpec(self.mesh, placements, self.shape, self.dtype)
        if len(_WITH_PLACEMENTS) >= 8192:
            _WITH_PLACEMENTS.clear()
        _WITH_PLACEMENTS[key] = spec
        return spec

    def __str__(self) -> str:
        pl = ", ".join(str(p) for p in self.placements)
        return f"DistSpec({list(self.shape)} {self.dtype} on mesh {self.mesh.short()} [{pl}])"

    __repr__ = __str__
