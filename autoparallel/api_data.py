"""``ap.shard_dataloader``: paddle's call form over an ordinary ``paddle.io.DataLoader``.

    loader = ap.shard_dataloader(loader, meshes=mesh, shard_dims="data")
    for x, y in loader:               # DistTensors: dim 0 sharded over the "data" mesh dim, replicated elsewhere

Each batch of the wrapped loader is the GLOBAL batch (the same on every rank, as the loader gives it to a single
process) and is laid out with ``shard_tensor``: the values are exactly the single-process batch, whatever the
degree. (paddle instead builds a ``DistributedBatchSampler`` so each rank loads only its part; the global batch
it forms interleaves samples differently from the original loader.) With ``is_dataset_splitted=True`` every
rank's loader already yields its own local part, which becomes the local shard (``dtensor_from_local``). On real
ranks every batch is checked to agree where the layout needs it (``autoparallel.data_agree``): a loader shuffled
differently per rank raises instead of training on a mix of batches, and a split loader's DistributedBatchSampler
must have ``num_replicas`` / ``rank`` equal to the shard dim's size and the rank's coordinate on it.

``meshes``: one mesh for every field, or a list with one mesh per field (pipeline: inputs on the first stage,
labels on the last). ``shard_dims``: the mesh dim (name or index) splitting dim 0 of the batch, one for all
fields or one per mesh; None replicates. ``input_keys``: the fields of a dict batch to lay out (others pass
through; with a list/tuple batch it raises). A field nested deeper (a dict or list inside a field) has every
tensor laid out like the field; numpy arrays are laid out as tensors. ``dense_tensor_idx`` (paddle's): one list per
field; for a tensor field a non-empty list keeps it a plain tensor, for a list field the listed positions stay plain
tensors. A 0-d tensor (a count) has no batch dim: it is replicated. A field that is already a DistTensor is moved
to the asked layout. As paddle's, the loader is its own iterator: ``next(loader)`` continues the latest pass,
``iter(loader)`` and ``loader()`` start a new one; ``loader.batch_sampler`` is the wrapped loader's.
"""
from __future__ import annotations

from collections.abc import Mapping

from autoparallel.config.fields import integral

_END = object()                 # the wrapped loader ran out

__all__ = ["shard_dataloader", "ShardDataloader"]


def shard_dataloader(dataloader, meshes, input_keys=None, shard_dims=None, is_dataset_splitted: bool = False,
                     dense_tensor_idx=None, *, check_agreement: bool = True):
    """paddle's ``dist.shard_dataloader`` (same arguments, same defaults). ``check_agreement`` (ours, on by
    default): on real ranks, refuse batches that differ where the layout needs them equal (``data_agree``);
    ``False`` skips its small all-reduce per tensor and batch for a loader known to agree."""
    return ShardDataloader(dataloader, meshes, input_keys, shard_dims, is_dataset_splitted, dense_tensor_idx,
                           check_agreement=check_agreement)


class ShardDataloader:
    def __init__(self, dataloader, meshes, input_keys=None, shard_dims=None, is_dataset_splitted=False,
                 dense_tensor_idx=None, *, check_agreement: bool = True):
        from autoparallel.core.mesh import ProcessMesh, as_mesh

        if not hasattr(dataloader, "__iter__"):
            raise TypeError(f"shard_dataloader expects an iterable data loader, got {type(dataloader).__name__}")
        if not isinstance(is_dataset_splitted, bool):
            raise TypeError(f"shard_dataloader: is_dataset_splitted must be True or False, got {is_dataset_splitted!r}")
        if not isinstance(check_agreement, bool):
            raise TypeError(f"shard_dataloader: check_agreement must be True or False, got {check_agreement!r}")
        self._check = check_agreement
        if is_dataset_splitted and shard_dims is None:
            raise ValueError("shard_dataloader: shard_dims must be set when is_dataset_splitted is True (the local "
                             "parts are split over that mesh dim)")
        many = isinstance(meshes, (list, tuple))
        # an entry may itself be a list of meshes: a list field laid out element by element (paddle's form)
        self._meshes = [[as_mesh(x) for x in m] if isinstance(m, (list, tuple)) else as_mesh(m)
                        for m in (meshes if many else [meshes])]
        if not self._meshes or any(m == [] for m in self._meshes):
            raise ValueError(f"shard_dataloader: meshes is empty, got {meshes!r:.80}")
        bad = [x for m in self._meshes for x in (m if isinstance(m, list) else [m]) if not isinstance(x, ProcessMesh)]
        if bad:
            raise TypeError(f"shard_dataloader expects ProcessMesh meshes, got {type(bad[0]).__name__} {bad[0]!r:.60}")
        self._dims = _shard_dims(shard_dims, self._meshes)
        if input_keys is not None and (isinstance(input_keys, str) or not all(isinstance(k, str) for k in input_keys)):
            raise TypeError(f"shard_dataloader: input_keys must be a list of dict keys, got {input_keys!r}")
        if input_keys is not None and len(self._meshes) > 1 and len(input_keys) != len(self._meshes):
            raise ValueError(f"shard_dataloader: input_keys {list(input_keys)} must name one dict key per mesh "
                             f"({len(self._meshes)} meshes given)")
        _check_dense(dense_tensor_idx)
        self._loader = dataloader
        self._keys = None if input_keys is None else list(input_keys)
        self._split = is_dataset_splitted
        self._dense = dense_tensor_idx
        sampler = getattr(dataloader, "batch_sampler", None)
        _check_not_split(sampler, is_dataset_splitted)
        if is_dataset_splitted:
            from autoparallel.comm.world import current_world

            world = current_world()
            if not world.is_simulated:
                _check_split_sampler(sampler, self._meshes, self._dims, world.rank)
        self.batch_size = getattr(dataloader, "batch_size", None) or getattr(sampler, "batch_size", None)
        self.dataset = getattr(dataloader, "dataset", None)          # ap.to_static reads batch shapes from it

    def __len__(self):
        return len(self._loader)

    @property
    def batch_sampler(self):
        """The wrapped loader's batch sampler (``loader.batch_sampler.set_epoch(e)`` as with paddle's loader)."""
        return getattr(self._loader, "batch_sampler", None)

    def __iter__(self):
        """A new pass over the loader; ``next(loader)`` continues the latest one (paddle's loader is its own
        iterator: ``next(loader)`` works without ``iter``, and ``iter(loader)`` / ``loader()`` restart it)."""
        self._it = self._batches()
        return self._it

    def _batches(self):
        from autoparallel.comm.world import current_world
        from autoparallel.data_agree import check_more
        from autoparallel.data_structure import describe

        mesh = self._check_mesh()
        real = not current_world().is_simulated         # the simulated world holds one batch for every rank
        it, index = iter(self._loader), 0
        while True:
            batch = next(it, _END)
            if self._check:                     # on real ranks: every rank has this batch, of one structure, or none
                shape = describe(batch, self._keys, self._listed, self._dense_of) if real and batch is not _END \
                    else None
                check_more(batch is not _END, mesh, index, shape)
            if batch is _END:
                return
            yield self._batch(batch)
            index += 1

    def _check_mesh(self):
        """The mesh whose ranks agree on each batch: every rank that lays out a field of it. With one mesh per field
        (a pipeline: inputs on the first stage, labels on the last) the union of the meshes: one of them when it
        holds the others' ranks, the whole world (its default group) when they cover it; otherwise the first
        field's mesh (a group over another set of ranks would have to be created on every rank of the job)."""
        from autoparallel.comm.world import current_world
        from autoparallel.core.mesh import ProcessMesh

        meshes = [x for m in self._meshes for x in (m if isinstance(m, list) else [m])]
        union = sorted({int(r) for m in meshes for r in m.process_ids})
        for m in meshes:
            if sorted(int(r) for r in m.process_ids) == union:
                return m
        world = current_world()
        if not world.is_simulated and union == list(range(world.world_size)):
            return ProcessMesh(union, dim_names=["ranks"])
        return meshes[0]

    def __next__(self):
        if getattr(self, "_it", None) is None:
            self._it = self._batches()
        return next(self._it)

    def __call__(self):
        self._it = None
        return self

    # ---- one batch ------------------------------------------------------------------------------------
    def _field(self, i: int, count: int):
        """(mesh, shard dim) of field ``i`` of ``count``."""
        if len(self._meshes) == 1:
            return self._meshes[0], self._dims[0]
        if len(self._meshes) != count:
            raise ValueError(f"shard_dataloader: {len(self._meshes)} meshes (one per field) but the batch has "
                             f"{count} fields")
        return self._meshes[i], self._dims[i]

    def _listed(self, i: int) -> bool:
        """Field ``i``'s mesh entry is a list of meshes (a list field laid out element by element)."""
        m = self._meshes[0] if len(self._meshes) == 1 else self._meshes[i] if i < len(self._meshes) else None
        return isinstance(m, list)

    def _dense_of(self, i: int) -> list:
        return list(self._dense[i]) if self._dense is not None and i < len(self._dense) and self._dense[i] else []

    def _place(self, t, mesh, dim, name: str):
        import numpy as np
        import paddle

        from autoparallel.api_tensor import dtensor_from_local, shard_tensor
        from autoparallel.data_agree import find_disagreement
        from autoparallel.dist_tensor import DistTensor

        if isinstance(t, np.ndarray) and t.ndim and t.dtype.kind in "biufc":
            t = paddle.to_tensor(t)                 # an iterable of numpy batches: laid out as the tensor it is
        if isinstance(t, DistTensor):
            return t if self._found is not None else self._relayout(t, mesh, dim, name)
        if not isinstance(t, paddle.Tensor):
            return t
        if not t.ndim:
            dim = self._scalar(t, dim, name)
        if self._found is not None:             # the checking walk (``_batch``): find, raise later on every rank
            found = find_disagreement(t, mesh, dim, self._split, f"batch field {name} ({t.dtype} {list(t.shape)})")
            self._found += [] if found is None else [found]
            return t
        if not self._split:
            return shard_tensor(t, mesh, _placements(mesh, dim))
        from autoparallel.comm.world import current_world

        if current_world().is_simulated:
            raise NotImplementedError("shard_dataloader(is_dataset_splitted=True) in the simulated world: each rank's "
                                      "loader yields its own part, which one process cannot tell apart; use the "
                                      "global batch (is_dataset_splitted=False)")
        return dtensor_from_local(t, mesh, _placements(mesh, dim))

    def _scalar(self, t, dim, name: str):
        """A 0-d tensor (a count, a step) has no batch dim to split: replicated; a rank's own value (split) has no
        global layout."""
        if self._split and dim is not None:
            raise ValueError(f"shard_dataloader(is_dataset_splitted=True): batch field {name} is a 0-d tensor "
                             f"({t.dtype}), which has no dim 0 to stack the ranks' parts on; give it a batch dim "
                             f"(shape [1] per rank) or leave it plain with dense_tensor_idx")
        return None

    def _relayout(self, t, mesh, dim, name: str):
        """A field that is already a DistTensor (a loader yielding laid-out batches): moved to the asked layout."""
        from autoparallel.dist_tensor import reshard

        if self._split:
            raise TypeError(f"shard_dataloader(is_dataset_splitted=True): batch field {name} is already a "
                            f"DistTensor; a split loader yields each rank's local part as a plain tensor")
        pl = _placements(mesh, dim if t.ndim else None)
        return t if t.mesh == mesh and list(t.placements) == pl else reshard(t, mesh, pl)

    _found = None                   # a list during the checking walk of a batch

    def _batch(self, batch):
        """On real ranks with the check on, two walks: the first only checks every tensor (``find_disagreement``)
        and then tells every rank of the meshes (``raise_found``, one pass per batch), so that all of them raise or
        none does; the second lays the batch out. The batch's structure agreed before (``check_more``), so an error
        of the first walk (a 0-d tensor in a split field) is the same on every rank: it is raised after
        ``raise_found``, which every rank then still runs."""
        from autoparallel.comm.world import current_world
        from autoparallel.data_agree import raise_found

        if self._check and not current_world().is_simulated:
            self._found, error = [], None
            try:
                self._walk(batch)
            except Exception as e:  # noqa: BLE001 -- the same on every rank (the structure agreed): raised below
                error = e
            finally:
                found, self._found = self._found, None
            raise_found(found, [x for m in self._meshes for x in (m if isinstance(m, list) else [m])])
            if error is not None:
                raise error
        return self._walk(batch)

    def _walk(self, batch):
        import numpy as np
        import paddle

        if isinstance(batch, (paddle.Tensor, np.ndarray)) or _is_dist(batch):
            mesh, dim = self._field(0, 1)
            return self._nested(batch, mesh, dim, [], "the batch")
        if isinstance(batch, Mapping):             # a dict, or a Mapping such as a tokenizer's BatchEncoding
            keys = list(batch) if self._keys is None else self._keys
            out = dict(batch)
            for i, k in enumerate(keys):
                if k not in batch:
                    raise KeyError(f"shard_dataloader: input key {k!r} is not in the batch {list(batch)}")
                mesh, dim = self._field(i, len(keys))
                out[k] = self._nested(batch[k], mesh, dim, self._dense_of(i), repr(k))
            return out
        if isinstance(batch, (list, tuple)):
            if self._keys is not None:
                raise ValueError(f"shard_dataloader: input_keys={self._keys} names fields of a dict batch, but the "
                                 f"loader yields a {type(batch).__name__}; drop input_keys (every field is laid "
                                 f"out) or yield dicts")
            return [self._nested(b, *self._field(i, len(batch)), self._dense_of(i), str(i))
                    for i, b in enumerate(batch)]
        raise TypeError(f"shard_dataloader: a batch must be a tensor, a list/tuple or a dict, got "
                        f"{type(batch).__name__}")

    def _nested(self, x, mesh, dim, dense, name: str):
        if isinstance(mesh, list):
            if not isinstance(x, (list, tuple)) or len(x) != len(mesh):
                raise ValueError(f"shard_dataloader: a list of {len(mesh)} meshes lays out a list field element by "
                                 f"element, but the field is {_what(x)}")
            return [t if j in dense else self._leaves(t, mm, dd, f"{name}[{j}]") for j, (t, (mm, dd)) in
                    enumerate(zip(x, _pairs(mesh, dim)))]
        if isinstance(x, (list, tuple)):
            return [t if j in dense else self._leaves(t, mesh, dim, f"{name}[{j}]") for j, t in enumerate(x)]
        return x if dense else self._leaves(x, mesh, dim, name)

    def _leaves(self, x, mesh, dim, name: str):
        """Every tensor of a nested field (dicts of tensors inside a dict batch) on the field's mesh and dim."""
        if isinstance(x, Mapping):
            return {k: self._leaves(v, mesh, dim, f"{name}[{k!r}]") for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [self._leaves(v, mesh, dim, f"{name}[{j}]") for j, v in enumerate(x)]
        return self._place(x, mesh, dim, name)


def _is_dist(x) -> bool:
    from autoparallel.dist_tensor import DistTensor

    return isinstance(x, DistTensor)


def _placements(mesh, dim) -> list:
    from autoparallel.placement import Replicate, Shard

    pl = [Replicate()] * mesh.ndim
    if dim is not None:
        pl[mesh.dim_index(dim)] = Shard(0)
    return pl


def _shard_dims(shard_dims, meshes) -> list:
    """One shard dim (or a list, for a list of meshes) per mesh entry, each checked against its mesh."""
    if isinstance(shard_dims, (list, tuple)):
        if len(shard_dims) != len(meshes):
            raise ValueError(f"shard_dataloader: shard_dims must be one per mesh ({len(meshes)}), got "
                             f"{list(shard_dims)}")
        dims = list(shard_dims)
    else:
        dims = [shard_dims] * len(meshes)
    dims = [integral(d) if integral(d) is not None else d for d in dims]      # numpy ints as ints
    for i, (m, d) in enumerate(zip(meshes, dims)):
        for mm, dd in _pairs(m, d):
            _check_dim(mm, dd, i)
    return dims


def _check_dim(mesh, dim, i: int) -> None:
    if dim is None:
        return
    if integral(dim) is None and not isinstance(dim, str):
        raise TypeError(f"shard_dataloader: shard_dims must be a mesh dim name or index, a list with one per mesh, "
                        f"or None; got {type(dim).__name__} {dim!r:.60}")
    try:
        mesh.dim_index(dim)
    except ValueError as e:
        raise ValueError(f"shard_dataloader: shard_dims {dim!r} for mesh {i} (dims {list(mesh.dim_names)}, "
                         f"shape {list(mesh.shape)}): {e}") from None


def _check_dense(dense) -> None:
    """paddle's ``dense_tensor_idx``: one list of positions per field (``[[], [0]]``)."""
    if dense is None:
        return
    ok = isinstance(dense, (list, tuple)) and all(
        isinstance(d, (list, tuple)) and all(isinstance(j, int) and not isinstance(j, bool) for j in d)
        for d in dense)
    if not ok:
        raise TypeError(f"shard_dataloader: dense_tensor_idx must be one list of positions per field (e.g. "
                        f"[[], [0]]: field 1 kept a plain tensor), got {dense!r:.80}")


def _pairs(mesh, dim) -> list:
    """(mesh, shard dim) of each element of a mesh entry (one mesh, or a list of meshes with one dim or a list)."""
    if not isinstance(mesh, list):
        return [(mesh, dim)]
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim] * len(mesh)
    if len(dims) != len(mesh):
        raise ValueError(f"shard_dataloader: shard_dims {dims} must be one per mesh of the entry ({len(mesh)})")
    return list(zip(mesh, dims))


def _what(x) -> str:
    return f"a {type(x).__name__} of {len(x)}" if isinstance(x, (list, tuple)) else f"a {type(x).__name__}"


def per_rank_sampler(sampler) -> bool:
    """Whether ``sampler`` is paddle's DistributedBatchSampler over more than one replica: each rank's loader then
    yields its own part of the dataset, not the global batch."""
    import paddle

    return isinstance(sampler, paddle.io.DistributedBatchSampler) and getattr(sampler, "nranks", 1) > 1


def _check_not_split(sampler, is_dataset_splitted) -> None:
    """A loader over paddle's DistributedBatchSampler (more than one replica) yields a different part on every
    rank; laid out as the global batch (``is_dataset_splitted=False``) the ranks would disagree on it."""
    if not is_dataset_splitted and per_rank_sampler(sampler):
        raise ValueError(f"shard_dataloader: the loader's DistributedBatchSampler splits the dataset over "
                         f"{sampler.nranks} replicas (this rank: {sampler.local_rank}), but is_dataset_splitted=False "
                         f"lays each batch out as the global batch, the same on every rank; pass "
                         f"is_dataset_splitted=True with shard_dims, or build the loader with a plain batch sampler")


def _check_split_sampler(sampler, meshes, dims, rank: int) -> None:
    """With ``is_dataset_splitted=True`` over paddle's DistributedBatchSampler, this rank's part is part
    ``local_rank`` of ``nranks``: they must be the rank's coordinate on the shard dim and that dim's size, or the
    stacked global batch repeats parts or leaves some out (equal shapes pass the cross-rank check)."""
    import paddle

    if not isinstance(sampler, paddle.io.DistributedBatchSampler):
        return
    for m, d in zip(meshes, dims):
        for mesh, dim in _pairs(m, d):
            if dim is None or not mesh.contains(rank):
                continue
            i = mesh.dim_index(dim)
            size, coord = mesh.shape[i], mesh.coords_of(rank)[i]
            if (sampler.nranks, sampler.local_rank) != (size, coord):
                raise ValueError(f"shard_dataloader(is_dataset_splitted=True): the loader's DistributedBatchSampler "
                                 f"gives rank {rank} part {sampler.local_rank} of {sampler.nranks}, but shard dim "
                                 f"{mesh.dim_names[i]!r} of the mesh {mesh.dim_names} {mesh.shape} stacks "
                                 f"{size} parts with this rank's at {coord}; build the sampler with "
                                 f"num_replicas={size}, rank={coord}")
            return
