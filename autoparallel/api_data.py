"""``ap.shard_dataloader``: paddle's call form over an ordinary ``paddle.io.DataLoader``.

    loader = ap.shard_dataloader(loader, meshes=mesh, shard_dims="data")
    for x, y in loader:               # DistTensors: dim 0 sharded over the "data" mesh dim, replicated elsewhere

Each batch of the wrapped loader is the GLOBAL batch (the same on every rank, as the loader gives it to a single
process) and is laid out with ``shard_tensor``: the values are exactly the single-process batch, whatever the
degree. (paddle instead builds a ``DistributedBatchSampler`` so each rank loads only its part; the global batch
it forms interleaves samples differently from the original loader.) With ``is_dataset_splitted=True`` every
rank's loader already yields its own local part, which becomes the local shard (``dtensor_from_local``). On real
ranks every batch is checked to agree where the layout needs it (``autoparallel.data_agree``): a loader shuffled
differently per rank raises instead of training on a mix of batches.

``meshes``: one mesh for every field, or a list with one mesh per field (pipeline: inputs on the first stage,
labels on the last). ``shard_dims``: the mesh dim (name or index) splitting dim 0 of the batch, one for all
fields or one per mesh; None replicates. ``input_keys``: the fields of a dict batch to lay out (others pass
through; with a list/tuple batch it raises). A field nested deeper (a dict or list inside a field) has every
tensor laid out like the field; numpy arrays are laid out as tensors. ``dense_tensor_idx`` (paddle's): one list per
field; for a tensor field a non-empty list keeps it a plain tensor, for a list field the listed positions stay plain
tensors.
"""
from __future__ import annotations

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
        if isinstance(shard_dims, (list, tuple)):
            if len(shard_dims) != len(self._meshes):
                raise ValueError(f"shard_dataloader: shard_dims must be one per mesh ({len(self._meshes)}), got "
                                 f"{list(shard_dims)}")
            self._dims = list(shard_dims)
        else:
            self._dims = [shard_dims] * len(self._meshes)
        for m, d in zip(self._meshes, self._dims):
            for mm, dd in _pairs(m, d):
                if dd is not None:
                    mm.dim_index(dd)               # ValueError naming the mesh's dims
        if input_keys is not None and (isinstance(input_keys, str) or not all(isinstance(k, str) for k in input_keys)):
            raise TypeError(f"shard_dataloader: input_keys must be a list of dict keys, got {input_keys!r}")
        self._loader = dataloader
        self._keys = None if input_keys is None else list(input_keys)
        self._split = is_dataset_splitted
        self._dense = dense_tensor_idx
        sampler = getattr(dataloader, "batch_sampler", None)
        _check_not_split(sampler, is_dataset_splitted)
        self.batch_size = getattr(dataloader, "batch_size", None) or getattr(sampler, "batch_size", None)
        self.dataset = getattr(dataloader, "dataset", None)          # ap.to_static reads batch shapes from it

    def __len__(self):
        return len(self._loader)

    def __iter__(self):
        for batch in self._loader:
            yield self._batch(batch)

    def __call__(self):
        return iter(self)

    # ---- one batch ------------------------------------------------------------------------------------
    def _field(self, i: int, count: int):
        """(mesh, shard dim) of field ``i`` of ``count``."""
        if len(self._meshes) == 1:
            return self._meshes[0], self._dims[0]
        if len(self._meshes) != count:
            raise ValueError(f"shard_dataloader: {len(self._meshes)} meshes (one per field) but the batch has "
                             f"{count} fields")
        return self._meshes[i], self._dims[i]

    def _dense_of(self, i: int) -> list:
        return list(self._dense[i]) if self._dense is not None and i < len(self._dense) and self._dense[i] else []

    def _place(self, t, mesh, dim):
        import numpy as np
        import paddle

        from autoparallel.api_tensor import dtensor_from_local, shard_tensor
        from autoparallel.data_agree import check_agree
        from autoparallel.placement import Replicate, Shard

        if isinstance(t, np.ndarray) and t.ndim and t.dtype.kind in "biuf":
            t = paddle.to_tensor(t)                 # an iterable of numpy batches: laid out as the tensor it is
        if not isinstance(t, paddle.Tensor):
            return t
        pl = [Replicate()] * mesh.ndim
        if dim is not None:
            pl[mesh.dim_index(dim)] = Shard(0)
        if self._check:
            check_agree(t, mesh, dim, self._split, f"a batch tensor {t.dtype} {list(t.shape)}")
        if not self._split:
            return shard_tensor(t, mesh, pl)
        from autoparallel.comm.world import current_world

        if current_world().is_simulated:
            raise NotImplementedError("shard_dataloader(is_dataset_splitted=True) in the simulated world: each rank's "
                                      "loader yields its own part, which one process cannot tell apart; use the "
                                      "global batch (is_dataset_splitted=False)")
        return dtensor_from_local(t, mesh, pl)

    def _batch(self, batch):
        import paddle

        if isinstance(batch, paddle.Tensor):
            mesh, dim = self._field(0, 1)
            return self._nested(batch, mesh, dim, [])
        if isinstance(batch, dict):
            keys = list(batch) if self._keys is None else self._keys
            out = dict(batch)
            for i, k in enumerate(keys):
                if k not in batch:
                    raise KeyError(f"shard_dataloader: input key {k!r} is not in the batch {list(batch)}")
                mesh, dim = self._field(i, len(keys))
                out[k] = self._nested(batch[k], mesh, dim, self._dense_of(i))
            return out
        if isinstance(batch, (list, tuple)):
            if self._keys is not None:
                raise ValueError(f"shard_dataloader: input_keys={self._keys} names fields of a dict batch, but the "
                                 f"loader yields a {type(batch).__name__}; drop input_keys (every field is laid "
                                 f"out) or yield dicts")
            return [self._nested(b, *self._field(i, len(batch)), self._dense_of(i)) for i, b in enumerate(batch)]
        raise TypeError(f"shard_dataloader: a batch must be a tensor, a list/tuple or a dict, got "
                        f"{type(batch).__name__}")

    def _nested(self, x, mesh, dim, dense):
        if isinstance(mesh, list):
            if not isinstance(x, (list, tuple)) or len(x) != len(mesh):
                raise ValueError(f"shard_dataloader: a list of {len(mesh)} meshes lays out a list field element by "
                                 f"element, but the field is {_what(x)}")
            return [t if j in dense else self._leaves(t, mm, dd) for j, (t, (mm, dd)) in
                    enumerate(zip(x, _pairs(mesh, dim)))]
        if isinstance(x, (list, tuple)):
            return [t if j in dense else self._leaves(t, mesh, dim) for j, t in enumerate(x)]
        return x if dense else self._leaves(x, mesh, dim)

    def _leaves(self, x, mesh, dim):
        """Every tensor of a nested field (dicts of tensors inside a dict batch) on the field's mesh and dim."""
        if isinstance(x, dict):
            return {k: self._leaves(v, mesh, dim) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [self._leaves(v, mesh, dim) for v in x]
        return self._place(x, mesh, dim)


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


def _check_not_split(sampler, is_dataset_splitted) -> None:
    """A loader over paddle's DistributedBatchSampler (more than one replica) yields a different part on every
    rank; laid out as the global batch (``is_dataset_splitted=False``) the ranks would disagree on it."""
    import paddle

    if is_dataset_splitted or not isinstance(sampler, paddle.io.DistributedBatchSampler):
        return
    if getattr(sampler, "nranks", 1) > 1:
        raise ValueError(f"shard_dataloader: the loader's DistributedBatchSampler splits the dataset over "
                         f"{sampler.nranks} replicas (this rank: {sampler.local_rank}), but is_dataset_splitted=False "
                         f"lays each batch out as the global batch, the same on every rank; pass "
                         f"is_dataset_splitted=True with shard_dims, or build the loader with a plain batch sampler")
