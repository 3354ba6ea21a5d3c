"""Data for parallel training: a byte-level text dataset every machine has, and deterministic sharding of
each global batch over the data axis of a mesh.

    ds = ByteTextDataset(seq_len=64)                      # the Python standard library's own source files
    loader = DistributedDataLoader(ds, global_batch_size=32, mesh=mesh, num_micro_batches=4, seed=0)
    for x, y in loader:                                   # DistTensors [8, 64]: batch dim sharded on "data"
        ...

Global batch ``b`` of an epoch is ``order[b*G:(b+1)*G]`` of a permutation seeded by ``(seed, epoch)``; it is
cut into ``num_micro_batches`` consecutive micro-batches, and micro-batch ``j`` into ``dp`` consecutive
local batches, one per data-parallel rank. So every run with the same seed and global batch size sees
the same global batches whatever its dp degree or micro-batching, and a single process (``mesh=None``)
gets the whole micro-batch.
"""
from __future__ import annotations

import glob
import os

import numpy as np
import paddle

from autoparallel.placement import Replicate, Shard


def stdlib_source_files() -> list:
    """The standard library's top-level ``*.py`` files, sorted (the same list on every rank)."""
    return sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))


class ByteTextDataset(paddle.io.Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes of text: item ``i`` is ``(x, y)`` with ``y`` the
    next byte of every position of ``x`` (int64 arrays of length ``seq_len``). Vocabulary: 256 bytes."""

    vocab_size = 256

    def __init__(self, seq_len: int, files=None, max_bytes: int = 2 ** 20):
        seq_len = _plain(seq_len)
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        files = stdlib_source_files() if files is None else list(files)
        chunks, total = [], 0
        for path in files:
            with open(path, "rb") as f:
                chunks.append(f.read(max_bytes - total))
            total += len(chunks[-1])
            if total >= max_bytes:
                break
        self.data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
        self.seq_len = seq_len
        self.n = (len(self.data) - 1) // seq_len
        if self.n < 1:
            raise ValueError(f"{len(self.data)} bytes of text hold no window of seq_len + 1 = {seq_len + 1} bytes")

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        w = self.data[i * self.seq_len: i * self.seq_len + self.seq_len + 1].astype("int64")
        return w[:-1], w[1:]


class GlobalBatchSampler(paddle.io.BatchSampler):
    """Yields the indices of one data-parallel rank's part of every micro-batch (see the module docstring)."""

    def __init__(self, num_samples: int, global_batch_size: int, dp_degree: int = 1, dp_rank: int = 0,
                 num_micro_batches: int = 1, shuffle: bool = True, seed: int = 0):
        check_global_batch(global_batch_size, dp_degree, num_micro_batches)
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank}")
        if num_samples < global_batch_size:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than one global batch of "
                             f"{global_batch_size}")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.dp_degree, self.dp_rank, self.num_micro_batches = dp_degree, dp_rank, num_micro_batches
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return (self.num_samples // self.global_batch_size) * self.num_micro_batches

    def __iter__(self):
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        g, k = self.global_batch_size, self.num_micro_batches
        micro = g // k
        local = micro // self.dp_degree
        for b in range(self.num_samples // g):
            for j in range(k):
                start = b * g + j * micro + self.dp_rank * local
                yield order[start:start + local].tolist()


def _plain(v):
    """A numpy integer as the Python int it is; anything else unchanged (and checked by its caller)."""
    return int(v) if isinstance(v, np.integer) else v


def check_global_batch(global_batch_size: int, dp_degree: int, num_micro_batches: int) -> None:
    for name, v in (("global_batch_size", global_batch_size), ("dp_degree", dp_degree),
                    ("num_micro_batches", num_micro_batches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if global_batch_size % (dp_degree * num_micro_batches):
        raise ValueError(f"global batch size {global_batch_size} must be divisible by dp x micro-batches = "
                         f"{dp_degree} x {num_micro_batches} = {dp_degree * num_micro_batches}")


def data_rank(mesh, rank: int, data_dims) -> tuple:
    """(dp degree, this rank's data-parallel index): row-major over the mesh's data dims."""
    coords = mesh.coords_of(rank)
    degree, index = 1, 0
    for d in data_dims:
        i = mesh.dim_index(d)
        degree, index = degree * mesh.shape[i], index * mesh.shape[i] + coords[i]
    return degree, index


class DistributedDataLoader:
    """A ``paddle.io.DataLoader`` per data-parallel index held by this process (one in a real job), whose
    local batches are assembled into DistTensors sharded on the batch dim over ``data_dims``.

    ``mesh=None``: a single process; yields plain tensors holding the whole micro-batch.
    """

    def __init__(self, dataset, global_batch_size: int, mesh=None, num_micro_batches: int = 1,
                 data_dims=("data",), shuffle: bool = True, seed: int = 0, num_workers: int = 0):
        from autoparallel.comm.world import current_world

        global_batch_size, num_micro_batches = _plain(global_batch_size), _plain(num_micro_batches)
        self.mesh, self.global_batch_size, self.num_micro_batches = mesh, global_batch_size, num_micro_batches
        if mesh is None:
            dp, held = 1, {0: 0}
        else:
            from autoparallel.mesh import ProcessMesh

            if not isinstance(mesh, ProcessMesh):
                raise TypeError(f"DistributedDataLoader: mesh must be an ap.ProcessMesh or None, got "
                                f"{type(mesh).__name__} {mesh!r:.80}")
            if not isinstance(data_dims, (list, tuple)) or not all(isinstance(d, str) for d in data_dims):
                raise TypeError(f"DistributedDataLoader: data_dims must be a list of mesh dim names, got "
                                f"{data_dims!r:.80}")
            unknown = [d for d in data_dims if d not in mesh.dim_names]
            if unknown:
                raise ValueError(f"data_dims {unknown} are not dims of the mesh {mesh.dim_names}")
            self.placements = [Shard(0) if n in data_dims else Replicate() for n in mesh.dim_names]
            ranks = current_world().local_ranks(mesh.process_ids)
            held = {r: data_rank(mesh, r, data_dims)[1] for r in ranks}
            dp = data_rank(mesh, mesh.process_ids[0], data_dims)[0]
        check_global_batch(global_batch_size, dp, num_micro_batches)
        self.dp_degree, self.held = dp, held
        self.samplers = {i: GlobalBatchSampler(len(dataset), global_batch_size, dp, i, num_micro_batches,
                                               shuffle, seed) for i in sorted(set(held.values()))}
        self.loaders = {i: paddle.io.DataLoader(dataset, batch_sampler=s, num_workers=num_workers)
                        for i, s in self.samplers.items()}

    def set_epoch(self, epoch: int) -> None:
        for s in self.samplers.values():
            s.set_epoch(epoch)

    def __len__(self):
        return len(next(iter(self.samplers.values())))

    def __iter__(self):
        from autoparallel.dist_tensor import dtensor_from_local

        order = sorted(self.loaders)
        micro = self.global_batch_size // self.num_micro_batches
        for batches in zip(*(self.loaders[i] for i in order)):
            by_index = dict(zip(order, batches))
            if self.mesh is None:
                yield tuple(by_index[0])
                continue
            fields = []
            for f in range(len(batches[0])):
                locals_ = {r: by_index[i][f] for r, i in self.held.items()}
                shape = [micro] + list(batches[0][f].shape[1:])
                fields.append(dtensor_from_local(locals_, self.mesh, self.placements, global_shape=shape))
            yield tuple(fields)

    def batches(self):
        """Micro-batches forever, advancing the epoch each time the dataset is exhausted."""
        epoch = 0
        while True:
            self.set_epoch(epoch)
            yield from self
            epoch += 1


__all__ = ["ByteTextDataset", "GlobalBatchSampler", "DistributedDataLoader", "stdlib_source_files",
           "check_global_batch", "data_rank"]
