"""ProcessMesh: an n-d array of ranks with named dims.

The communication groups of every mesh dim are created with the mesh (in a real multi-process world),
in one fixed order on every rank, each followed by a barrier: gloo fails when group creation interleaves
with other collectives. That step lives in ``autoparallel.comm.groups`` (it needs paddle); this module only
calls it, by name, once paddle is loaded. Pure code (specs, rules, reshard planning) uses meshes without
any process group.
"""
from __future__ import annotations

import importlib
import sys
from typing import Sequence

import numpy as np

from autoparallel.core.hashing import HashedOnce

# Where the process groups of a new mesh are made: the one paddle-touching step of a mesh, kept outside the
# core and reached by name, only once paddle is loaded (a process without paddle has no distributed job).
GROUPS_HOOK = ("autoparallel.comm.groups", "on_mesh_created")


def _create_groups(mesh) -> None:
    if "paddle" not in sys.modules:
        return
    module, name = GROUPS_HOOK
    getattr(importlib.import_module(module), name)(mesh)


def _current_rank() -> int:
    """This process's rank (the simulated world's current rank), 0 before any distributed setup."""
    if "paddle" not in sys.modules:
        return 0
    return importlib.import_module("autoparallel.comm.world").current_world().rank


def _mesh_array(mesh, shape, process_ids):
    """paddle's call forms: ``mesh`` (nested list / ndarray / another ProcessMesh) or ``shape`` + ``process_ids``."""
    if mesh is None:
        if shape is None or process_ids is None:
            raise ValueError(f"ProcessMesh needs mesh=<nested list of ranks>, or both shape= and process_ids=; got "
                             f"shape={shape!r}, process_ids={process_ids!r}")
        shape = _checked_shape(shape)
        if isinstance(process_ids, (str, bytes)) or not hasattr(process_ids, "__iter__"):
            raise TypeError(f"ProcessMesh: process_ids must be a list of ranks, got {type(process_ids).__name__} "
                            f"{process_ids!r:.60}")
        ids = np.asarray(list(process_ids))
        if ids.size != int(np.prod(shape)):
            raise ValueError(f"ProcessMesh: process_ids has {ids.size} ranks but shape {list(shape)} holds "
                             f"{int(np.prod(shape))}")
        return ids.reshape(list(shape))
    if hasattr(mesh, "dim_names") and hasattr(mesh, "process_ids") and not isinstance(mesh, (list, tuple)):
        mesh = np.asarray(mesh.mesh)               # ours or paddle.distributed.ProcessMesh
    if shape is not None or process_ids is not None:
        arr = np.asarray(mesh)
        if (shape is not None and list(arr.shape) != list(shape)) or \
                (process_ids is not None and arr.reshape(-1).tolist() != list(process_ids)):
            raise ValueError(f"ProcessMesh: mesh={np.asarray(mesh).tolist()} disagrees with shape={shape!r} / "
                             f"process_ids={process_ids!r}; give the mesh, or shape and process_ids")
    return mesh


def _checked_shape(shape) -> list:
    """paddle's ``shape=`` of a mesh: a list of positive ints (numpy's too)."""
    ok = isinstance(shape, (list, tuple, np.ndarray)) and len(shape) > 0 and all(
        isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_)) for n in shape)
    if not ok:
        raise TypeError(f"ProcessMesh: shape must be a non-empty list of ints, got {type(shape).__name__} "
                        f"{shape!r:.60}")
    if any(n <= 0 for n in shape):
        raise ValueError(f"ProcessMesh: shape must hold positive sizes, got {list(shape)}")
    return [int(n) for n in shape]


def as_mesh(mesh):
    """Our ProcessMesh for a ``paddle.distributed.ProcessMesh`` (same ranks and dim names); anything else is
    returned unchanged, for the caller's own type check."""
    if not isinstance(mesh, ProcessMesh) and type(mesh).__module__.startswith("paddle") \
            and hasattr(mesh, "dim_names") and hasattr(mesh, "mesh"):
        return ProcessMesh(np.asarray(mesh.mesh).tolist(), list(mesh.dim_names))
    return mesh


class ProcessMesh(HashedOnce):
    """``ProcessMesh(mesh, dim_names)`` in paddle's forms: ``mesh`` a nested list or ndarray of ranks (or another
    ProcessMesh), or ``shape=`` with ``process_ids=``. ``dim_names`` default to ``d0, d1, ...`` as in paddle."""

    def __init__(self, mesh=None, dim_names: Sequence[str] | None = None, shape=None, process_ids=None, *,
                 create_groups: bool = True):
        if dim_names is None and hasattr(mesh, "dim_names") and not isinstance(mesh, (list, tuple)):
            dim_names = list(mesh.dim_names)
        mesh = _mesh_array(mesh, shape, process_ids)
        try:
            arr = np.asarray(mesh)
        except ValueError:
            raise ValueError(f"ProcessMesh expects a non-empty rectangular nested list of ints, got {mesh!r}") from None
        if arr.dtype == object or arr.size == 0:
            raise ValueError(f"ProcessMesh expects a non-empty rectangular nested list of ints, got {mesh!r}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"ProcessMesh expects integer ranks, got dtype {arr.dtype} from {mesh!r}")
        if arr.ndim == 0:
            arr = arr.reshape(1)
        flat = arr.reshape(-1).tolist()
        if min(flat) < 0:
            raise ValueError(f"ProcessMesh ranks must be non-negative, got {sorted(r for r in flat if r < 0)}")
        if len(set(flat)) != len(flat):
            dup = sorted({r for r in flat if flat.count(r) > 1})
            raise ValueError(f"ProcessMesh ranks must be unique, got duplicates {dup} in {arr.tolist()}")
        if dim_names is None:
            dim_names = [f"d{i}" for i in range(arr.ndim)]
        dim_names = list(dim_names)
        if len(dim_names) != arr.ndim:
            raise ValueError(f"ProcessMesh of shape {list(arr.shape)} needs {arr.ndim} dim_names, got {dim_names}")
        if len(set(dim_names)) != len(dim_names) or not all(isinstance(n, str) for n in dim_names):
            raise ValueError(f"ProcessMesh dim_names must be unique strings, got {dim_names}")
        self._arr = arr.astype(np.int64)
        self._arr.setflags(write=False)
        self._names = tuple(dim_names)
        self._shape = tuple(int(n) for n in self._arr.shape)
        self._flat = tuple(int(r) for r in flat)
        self._key = (self._shape, self._flat, self._names)
        self._rehash()
        self._groups: dict = {}            # mesh dim -> its communication groups (computed once)
        self._coords = {int(r): tuple(int(c) for c in idx) for idx, r in np.ndenumerate(self._arr)}
        if create_groups:
            _create_groups(self)

    # ---- basic properties -------------------------------------------------------------------
    @property
    def shape(self) -> list[int]:
        return list(self._shape)

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def dim_names(self) -> list[str]:
        return list(self._names)

    @property
    def process_ids(self) -> list[int]:
        return list(self._flat)

    @property
    def size(self) -> int:
        return len(self._flat)

    @property
    def mesh(self) -> np.ndarray:
        return self._arr

    def dim_index(self, dim: int | str) -> int:
        if isinstance(dim, str):
            if dim not in self._names:
                raise ValueError(f"mesh has dims {list(self._names)}, got dim name {dim!r}")
            return self._names.index(dim)
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or not -self.ndim <= dim < self.ndim:
            raise ValueError(f"mesh dim must be an int in [-{self.ndim}, {self.ndim}) or a name in {list(self._names)}, got {dim!r}")
        return int(dim) % self.ndim      # a numpy int is an index as paddle's meshes take it

    def get_dim_size(self, dim: int | str) -> int:
        return int(self._arr.shape[self.dim_index(dim)])

    dim_size = get_dim_size

    def get_group(self, dim_name: str | None = None):
        """paddle's form: the communication group along ``dim_name`` through this process's rank (the name may be
        left out on a 1-D mesh). None stands for the whole world, as in ``paddle.distributed`` calls."""
        if dim_name is None:
            if self.ndim > 1:
                raise ValueError(f"get_group(dim_name): a mesh with dims {list(self._names)} needs the dim name")
            dim_name = self._names[0]
        self.dim_index(dim_name)                    # a dim this mesh does not have is named first
        if "paddle" in sys.modules and importlib.import_module("autoparallel.comm.world").current_world().is_simulated:
            raise RuntimeError("get_group: the simulated world (ap.simulate) runs every rank in this process and "
                               "has no paddle process groups; groups exist in a job started with "
                               "paddle.distributed.launch")
        rank = _current_rank()
        ranks = self.group_ranks(dim_name, rank)
        return importlib.import_module(GROUPS_HOOK[0]).get_group(ranks)

    def contains(self, rank: int) -> bool:
        return rank in self._coords

    def coords_of(self, rank: int) -> tuple[int, ...]:
        try:
            return self._coords[rank]
        except (KeyError, TypeError):
            raise ValueError(f"rank {rank} is not in the mesh {self._arr.tolist()}") from None

    def rank_at(self, coords: Sequence[int]) -> int:
        return int(self._arr[tuple(coords)])

    def group_ranks(self, mesh_dim: int | str, rank: int) -> list[int]:
        """Ranks along ``mesh_dim`` through ``rank`` (its communication group on that dim)."""
        i = self.dim_index(mesh_dim)
        c = list(self.coords_of(rank))
        c[i] = slice(None)
        return self._arr[tuple(c)].tolist()

    def all_groups(self, mesh_dim: int | str) -> list[list[int]]:
        """Every communication group along ``mesh_dim``, in a fixed order (row-major over the other dims)."""
        i = self.dim_index(mesh_dim)
        groups = self._groups.get(i)
        if groups is None:
            moved = np.moveaxis(self._arr, i, -1)
            groups = self._groups[i] = tuple(tuple(g) for g in moved.reshape(-1, moved.shape[-1]).tolist())
        return [list(g) for g in groups]

    # ---- sub-meshes ---------------------------------------------------------------------------
    def __getitem__(self, index) -> "ProcessMesh":
        sub = self._arr[index]
        if np.ndim(sub) == 0:
            return ProcessMesh([int(sub)], [self._names[-1]])
        # names of the dims that survive indexing
        kept = _surviving_dims(self._arr.shape, index)
        return ProcessMesh(sub.tolist(), [self._names[k] for k in kept] if len(kept) == sub.ndim else None)

    def get_mesh_with_dim(self, dim_name: str, index=None) -> "ProcessMesh":
        """paddle's form: the mesh with ``dim_name`` moved first; with ``index``, the sub-mesh at that position
        of ``dim_name`` (that dim removed; an int index) or the slice of it (a slice)."""
        i = self.dim_index(dim_name)
        order = [i] + [k for k in range(self.ndim) if k != i]
        arr = np.transpose(self._arr, order)
        names = [self._names[k] for k in order]
        if index is None:
            return ProcessMesh(arr.tolist(), names)
        if isinstance(index, slice):
            return ProcessMesh(arr[index].tolist(), names)
        if isinstance(index, tuple) and len(index) == 1:       # paddle indexes the moved mesh: new_mesh[(k,)]
            index = index[0]
        return self.get_submesh_with_dim(self._names[i], index)

    def get_submesh_with_dim(self, dim_name: str, index: int | None = None) -> "ProcessMesh":
        """paddle's form (no ``index``): the 1-D mesh along ``dim_name`` through this process's rank (None when
        the rank is not in the mesh, as in paddle). With ``index``: the sub-mesh at position ``index`` of dim
        ``dim_name`` (that dim removed), i.e. ``get_mesh_with_dim(dim_name, index)``."""
        if index is None:
            rank = _current_rank()
            if not self.contains(rank):
                return None
            return ProcessMesh(self.group_ranks(dim_name, rank), [self._names[self.dim_index(dim_name)]])
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"get_submesh_with_dim(dim_name, index): index must be an int, got {index!r}")
        i = self.dim_index(dim_name)
        size = self._arr.shape[i]
        if not -size <= index < size:                    # negative: from the end, as paddle's numpy indexing
            raise ValueError(f"mesh dim {dim_name!r} has size {size}, got index {index}")
        index = int(index) % size
        sub = np.take(self._arr, index, axis=i)
        names = [n for k, n in enumerate(self._names) if k != i]
        if sub.ndim == 0:
            return ProcessMesh([int(sub)], [self._names[i]])
        return ProcessMesh(sub.tolist(), names)

    # ---- identity -------------------------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, ProcessMesh) and self._key == other._key)

    def __hash__(self) -> int:
        return self._hash

    def _hash_key(self):
        return self._key

    def __repr__(self) -> str:
        return f"ProcessMesh({self._arr.tolist()}, dim_names={list(self._names)})"

    def short(self) -> str:
        return "x".join(str(s) for s in self._arr.shape)


def _surviving_dims(shape, index) -> list[int]:
    if not isinstance(index, tuple):
        index = (index,)
    kept, d = [], 0
    for ix in index:
        if ix is Ellipsis:
            raise TypeError("ProcessMesh indexing does not support Ellipsis")
        if not isinstance(ix, (int, np.integer)):
            kept.append(d)
        d += 1
    kept.extend(range(d, len(shape)))
    return kept


def mesh_from_shape(shape: Sequence[int], dim_names: Sequence[str] | None = None, **kw) -> ProcessMesh:
    """A mesh over ranks 0..prod(shape)-1 in row-major order, e.g. ``mesh_from_shape([2, 4])``."""
    n = int(np.prod(shape))
    return ProcessMesh(np.arange(n).reshape(shape).tolist(), dim_names, **kw)
