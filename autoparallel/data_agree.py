"""Batches that must agree across ranks, checked on real ranks before they are laid out.

``shard_tensor`` takes a tensor that is the same on every rank and keeps each rank's slice; ``dtensor_from_local``
takes each rank's own part and multiplies its shape by the shard count. A loader whose ranks disagree trains
silently wrong: a shuffle seeded per rank (or ``paddle.randint`` drawn on each rank) gives every rank a slice of
a DIFFERENT global batch, and tensor-parallel peers that should hold one replica hold different ones. So, on real
ranks, ``shard_dataloader`` fingerprints every tensor it lays out (shape and CRC-32 of the bytes, float32-exact
numbers) and all-reduces max and min of the fingerprint over the groups of the mesh dims that must agree:

* ``is_dataset_splitted=False``: every mesh dim (the whole global batch is the same on every rank of the mesh);
* ``is_dataset_splitted=True``: the dims other than the shard dim (replicas) must agree on the whole part, and the
  shard dim on the part's shape (parts of unequal sizes cannot be stacked by ``dtensor_from_local``).

A disagreement raises ``ValueError`` naming the mesh dim and the ranks, on every rank of the mesh: the ranks of
the disagreeing group find it, and one slot vector per batch all-reduced over the whole mesh (``raise_found``)
tells the others, which would otherwise go on into the next collective alone. Loaders of different lengths raise on
every rank at the first batch one of them lacks (``check_more``), where the ranks that still had one would have
waited in its collectives; batches of different structures (``data_structure``: a missing key, a list of another
length, a tensor against None) raise there too, in the same vector. Cost: one small all-reduce per checked dim
and tensor per batch, and one per mesh dim and batch for the lengths and structures and (meshes of two or more
dims) for telling every rank. The simulated world holds one batch for all ranks: nothing to check there.
"""
from __future__ import annotations

import zlib

import numpy as np


def fingerprint(t, shape_only: bool = False) -> list:
    """Shape, then the CRC-32 of the bytes as two 16-bit halves (every number exact in float32)."""
    out = [float(len(t.shape))] + [float(d) for d in t.shape]
    if not shape_only:
        crc = zlib.crc32(np.ascontiguousarray(t.numpy()).tobytes())
        out += [float(crc >> 16), float(crc & 0xFFFF)]
    return out


def _disagree(values: list, ranks: list) -> bool:
    """True when ``values`` is not the same on every rank of ``ranks`` (max and -min in one all-reduce)."""
    import paddle

    from autoparallel.comm.transport import transport_for
    from autoparallel.comm.world import current_world

    world = current_world()
    v = paddle.to_tensor(np.array(values + [-x for x in values], dtype="float32"))
    out = transport_for(world).all_reduce({world.rank: v}, list(ranks), "max")[world.rank].numpy()
    n = len(values)
    return bool(np.any(out[:n] != -out[n:]))


def check_agree(t, mesh, shard_dim, split: bool, what: str) -> None:
    """Raise on every rank of ``mesh`` when ``t`` (this rank's batch tensor) differs where the layout needs it equal
    (module docstring): ``find_disagreement`` then ``raise_found``. A loader with many tensors per batch collects
    the findings of all of them and calls ``raise_found`` once (``ShardDataloader``)."""
    found = find_disagreement(t, mesh, shard_dim, split, what)
    raise_found([] if found is None else [found], [mesh])


def find_disagreement(t, mesh, shard_dim, split: bool, what: str):
    """``(mesh, mesh dim, message)`` when ``t`` differs from its peers along a dim where the layout needs it equal,
    else None. It does not raise: only the ranks of the disagreeing group see it, and a rank that raised alone
    would leave the others waiting in the next collective; ``raise_found`` tells every rank of the mesh."""
    from autoparallel.comm.world import current_world

    world = current_world()
    if world.is_simulated or not mesh.contains(world.rank):
        return None
    sd = None if shard_dim is None else mesh.dim_index(shard_dim)
    coords = mesh.coords_of(world.rank)
    full, shape, found = fingerprint(t), None, None
    for d in range(mesh.ndim):          # every dim's all-reduce runs on every rank, a finding or not
        if mesh.shape[d] == 1:
            continue
        ranks = next(g for g in mesh.all_groups(d) if world.rank in g)
        if split and d == sd:
            shape = shape or fingerprint(t, shape_only=True)
            if _disagree(shape, ranks) and found is None:
                found = (mesh, d, f"shard_dataloader(is_dataset_splitted=True): {what} has local parts of different "
                                  f"shapes on the ranks {list(ranks)} of mesh dim {mesh.dim_names[d]!r} (this rank "
                                  f"{world.rank}: {list(t.shape)}); every rank's part must have one size (paddle's "
                                  f"DistributedBatchSampler pads the dataset to equal parts; or drop_last=True)")
            continue
        if _disagree(full, ranks) and found is None:
            how = ("the loader must yield the same global batch on every rank (is_dataset_splitted=False): seed "
                   "its shuffle and any random draw identically on every rank, or pass is_dataset_splitted=True "
                   "with each rank loading its own part") if not split else \
                  ("ranks that differ only along this dim hold replicas of one part: give them the same data "
                   "(a DistributedBatchSampler with num_replicas = the shard dim's size and rank = the rank's "
                   "coordinate on it)")
            found = (mesh, d, f"shard_dataloader: {what} differs between the ranks {list(ranks)} of mesh dim "
                              f"{mesh.dim_names[d]!r} (this rank {world.rank}, coordinates {list(coords)}); {how}")
    return found


def raise_found(found: list, meshes: list) -> None:
    """Raise on every rank of every mesh of ``meshes`` when any of its ranks found a disagreement (``found``: this
    rank's ``find_disagreement`` results). Per mesh (in the given order; each rank runs those it belongs to), each
    rank's slot (0, or 1 + the mesh dim of its first finding there) is all-reduced with max over every mesh dim in
    turn, i.e. over the whole mesh, as ``check_more``; the rank raises only after all its meshes are reduced, so
    its peers are not left in a later reduction (a mesh with one dim of size > 1 needs none: its one group is the
    whole mesh). A rank with a finding raises its own message; the others name the ranks and dims that found one."""
    from autoparallel.comm import collectives
    from autoparallel.comm.world import current_world

    world = current_world()
    if world.is_simulated:
        return
    seen, others = [], []
    for mesh in meshes:
        if mesh in seen or not mesh.contains(world.rank):
            continue
        seen.append(mesh)
        if sum(n > 1 for n in mesh.shape) < 2:
            continue                    # one group holds the whole mesh: every rank saw the finding itself
        ids = [int(r) for r in np.asarray(mesh.process_ids).reshape(-1)]
        slots = np.zeros(len(ids), dtype="float32")
        mine = [d for m, d, _ in found if m == mesh]
        slots[ids.index(world.rank)] = 1.0 + mine[0] if mine else 0.0
        v = collectives.mesh_max(slots, mesh)
        others += [f"rank {r} along mesh dim {mesh.dim_names[int(s) - 1]!r}" for r, s in zip(ids, v.numpy()) if s]
    if found:
        raise ValueError(found[0][2])
    if others:
        raise ValueError(f"shard_dataloader: a batch differs across ranks where its layout needs it equal, found by "
                         f"{', '.join(others)} (this rank {world.rank} saw no difference in its own groups); every "
                         f"rank raises, so none is left waiting in the next collective")


def check_more(has_batch: bool, mesh, index: int, structure: dict | None = None) -> None:
    """Raise on every rank of ``mesh`` when its loaders do not all yield batch ``index``: a rank whose loader ran out
    would leave its peers waiting in that batch's collectives (a hang, or a collective paired with another). Each
    rank's slot (1: has the batch, 2: ran out) is all-reduced with max over every mesh dim in turn, which reduces
    over the whole mesh: every rank sees every rank's slot, so all of them raise or none does. The same vector
    carries each rank's batch ``structure`` (``data_structure.describe``: its codes, and their negation for the
    minimum): batches of different structures raise here on every rank, before any of their collectives."""
    from autoparallel.comm import collectives
    from autoparallel.comm.world import current_world
    from autoparallel.data_structure import SIZE, explain

    world = current_world()
    if world.is_simulated or not mesh.contains(world.rank):
        return
    ids = [int(r) for r in np.asarray(mesh.process_ids).reshape(-1)]
    n = len(ids)
    slots = np.zeros(2 * n + 2 * SIZE, dtype="float32")
    slots[ids.index(world.rank)] = 1.0 if has_batch else 2.0
    if structure is None:                       # no batch: leaves the maximum and the minimum to the others
        slots[2 * n:] = -1.0
        slots[2 * n + SIZE:] = -float(2 ** 25)
    else:
        codes = np.asarray(structure["codes"], dtype="float32")
        slots[n + ids.index(world.rank)] = codes[3]             # the CRC of the whole structure, per rank
        slots[2 * n:2 * n + SIZE], slots[2 * n + SIZE:] = codes, -codes
    v = collectives.mesh_max(slots, mesh)
    got = v.numpy()
    short = [r for r, s in zip(ids, got[:n]) if s == 2.0]
    if short and len(short) < len(ids):
        raise ValueError(f"shard_dataloader: the ranks' loaders have different lengths: the ranks {short} ran out "
                         f"after {index} batches while the ranks {[r for r in ids if r not in short]} have batch "
                         f"{index + 1}; every rank of the mesh must yield the same number of batches (paddle's "
                         f"DistributedBatchSampler pads the parts to one length; or drop the extra batches)")
    hi, lo = got[2 * n:2 * n + SIZE], -got[2 * n + SIZE:]
    if structure is not None and not short and np.any(hi != lo):
        groups: dict = {}
        for r, c in zip(ids, got[n:2 * n]):
            groups.setdefault(float(c), []).append(r)
        raise ValueError(f"shard_dataloader: batch {index + 1} has a different structure on the ranks of the mesh "
                         f"{ids} (ranks alike: {sorted(groups.values())}): {explain(structure, hi, lo, world.rank)}; "
                         f"every rank's loader must yield batches of one structure (the same fields, and in each "
                         f"the same kinds, ndims, dtypes and list lengths)")

