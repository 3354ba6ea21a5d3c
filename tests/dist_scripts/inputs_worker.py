"""Runs on every rank (2): shard_dataloader's cross-rank agreement on real gloo ranks; reports {check: result}."""
import traceback

import numpy as np
import paddle

import autoparallel as ap
from autoparallel.testing.launch import write_result

world = ap.init_parallel_env()
RANK = world.rank
MESH = ap.ProcessMesh([0, 1], dim_names=["data"])


class Rows(paddle.io.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return np.arange(i * 3, i * 3 + 3).astype("int64"), np.array([i], "int64")


def same_global():
    """The same shuffled global batch on both ranks (paddle's RandomSampler draws from numpy's global generator:
    seeded alike): each rank holds its half, two epochs, len() of the wrapped loader."""
    out = []
    for epoch in range(2):
        np.random.seed(7 + epoch)
        ref = [b[0].numpy() for b in paddle.io.DataLoader(Rows(), batch_size=4, shuffle=True)]
        np.random.seed(7 + epoch)
        loader = ap.shard_dataloader(paddle.io.DataLoader(Rows(), batch_size=4, shuffle=True), MESH, shard_dims="data")
        got = [b[0].full().numpy() for b in loader]
        out.append(len(loader) == 3 and len(got) == 3 and all(np.array_equal(a, b) for a, b in zip(got, ref)))
    return all(out)


def paddle_seed_only_shuffle():
    """paddle.seed alike, numpy's generator not: the shuffles differ per rank (silently mixed batches before)."""
    paddle.seed(7)
    np.random.seed(1000 + RANK)          # numpy's generator as fresh processes leave it: different per rank
    next(iter(ap.shard_dataloader(paddle.io.DataLoader(Rows(), batch_size=4, shuffle=True), MESH, shard_dims="data")))
    return "no error"


def rank_drawn():
    """paddle.randint drawn on each rank (a per-rank seed): the global batches differ."""
    paddle.seed(100 + RANK)
    batches = [(paddle.randint(0, 64, [4, 8]), paddle.randint(0, 64, [4, 8]))]
    next(iter(ap.shard_dataloader(batches, MESH, shard_dims="data")))
    return "no error"


def rank_drawn_unchecked():
    """The same batches with check_agreement=False: laid out without the check (the user's opt-out)."""
    paddle.seed(100 + RANK)
    batches = [(paddle.randint(0, 64, [4, 8]), paddle.randint(0, 64, [4, 8]))]
    ids, _ = next(iter(ap.shard_dataloader(batches, MESH, shard_dims="data", check_agreement=False)))
    return list(ids.shape)


def split_sampler():
    """is_dataset_splitted=True over paddle's DistributedBatchSampler, drop_last=False: the last parts are short
    but equal (the sampler pads), and the global batch stacks the ranks' parts in rank order."""
    sampler = paddle.io.DistributedBatchSampler(Rows(), batch_size=4, drop_last=False)
    plain = [b[0].numpy() for b in paddle.io.DataLoader(Rows(), batch_sampler=sampler)]
    loader = ap.shard_dataloader(paddle.io.DataLoader(Rows(), batch_sampler=sampler), MESH, shard_dims="data",
                                 is_dataset_splitted=True)
    shapes = []
    for mine, b in zip(plain, loader):
        full = b[0].full().numpy()
        n = mine.shape[0]
        assert np.array_equal(full[RANK * n:(RANK + 1) * n], mine)
        shapes.append(list(full.shape))
    return shapes


def split_uneven():
    part = paddle.ones([3 if RANK == 0 else 2, 4])
    next(iter(ap.shard_dataloader([part], MESH, shard_dims="data", is_dataset_splitted=True)))
    return "no error"


def split_replicas_differ():
    mesh = ap.ProcessMesh([[0, 1]], dim_names=["data", "model"])
    part = paddle.full([2, 4], float(RANK))
    next(iter(ap.shard_dataloader([part], mesh, shard_dims="data", is_dataset_splitted=True)))
    return "no error"


def split_lengths_differ():
    """Each rank's own parts, rank 0 three batches and rank 1 two: rank 1 ran out while rank 0 would wait in the
    third batch's collectives. Both ranks raise at the third batch; afterwards a collective still pairs."""
    parts = [paddle.full([2, 4], float(RANK * 10 + k)) for k in range(3 if RANK == 0 else 2)]
    seen = []
    try:
        for (b,) in ap.shard_dataloader([(p,) for p in parts], MESH, shard_dims="data", is_dataset_splitted=True):
            seen.append(float(b.full().sum()))
    except ValueError as e:
        x = ap.shard_tensor(paddle.ones([2, 2]), MESH, [ap.Shard(0)])
        return [seen, str(e), float(x.full().sum())]
    return [seen, "no error"]


def pipeline_lengths_differ():
    """One mesh per field (a pipeline's inputs on stage [0], labels on stage [1]), rank 0's loader three batches and
    rank 1's two: the check ran on the first field's mesh only, so rank 1 never took part and the two ranks silently
    went through different numbers of batches. Both ranks now raise at the third batch, over the meshes' union."""
    stages = [ap.ProcessMesh([0], dim_names=["pp"]), ap.ProcessMesh([1], dim_names=["pp"])]
    parts = [(paddle.full([2, 4], float(k)), paddle.full([2], float(k))) for k in range(3 if RANK == 0 else 2)]
    seen = []
    try:
        for x, y in ap.shard_dataloader(parts, stages):
            seen.append(float((x if RANK == 0 else y).full().flatten()[0]))     # each rank reads its own stage
    except ValueError as e:
        x = ap.shard_tensor(paddle.ones([2, 2]), MESH, [ap.Shard(0)])
        return [seen, str(e), float(x.full().sum())]
    return [seen, "no error"]


def _every_rank_raises(batch, meshes=MESH, **kw):
    """One batch of a structure that differs per rank: [message, a whole-mesh collective's sum afterwards]."""
    try:
        next(iter(ap.shard_dataloader([batch], meshes, **kw)))
    except ValueError as e:
        x = ap.shard_tensor(paddle.ones([2, 2]), MESH, [ap.Shard(0)])
        return [str(e), float(x.full().sum())]
    return ["no error"]


def structure_differs():
    """Batches whose structure differs per rank: rank 1 raised alone partway through the checking walk (KeyError,
    a list of 2 meshes given one tensor) or skipped a tensor's collectives, while rank 0 waited in the next one.
    Every rank now raises before the batch's collectives, naming the field; a collective afterwards pairs."""
    ids = paddle.full([2, 3], 1.0)
    out = {"key_missing": _every_rank_raises({"ids": ids, "labels": ids} if RANK == 0 else {"ids": ids}, MESH,
                                             input_keys=["ids", "labels"], shard_dims="data"),
           "none_field": _every_rank_raises((ids, ids if RANK == 0 else None), shard_dims="data"),
           "field_count": _every_rank_raises((ids, ids) if RANK == 0 else (ids, ids, ids), shard_dims="data"),
           "list_length": _every_rank_raises((ids, [ids, ids] if RANK == 0 else [ids]), [MESH, [MESH, MESH]],
                                             shard_dims=["data", ["data", None]]),
           "zero_d_split": _every_rank_raises((ids, paddle.ones([2]) if RANK == 0 else paddle.to_tensor(1.0)),
                                              shard_dims="data", is_dataset_splitted=True)}
    return out


def same_lengths_end_together():
    """Equal lengths: the pass ends on every rank without an error, and again for a second pass."""
    parts = [(paddle.full([2, 4], float(k)),) for k in range(2)]
    loader = ap.shard_dataloader(parts, MESH, shard_dims="data", is_dataset_splitted=True)
    return [len(list(loader)), len(list(loader))]


res = {}
for check in (same_global, paddle_seed_only_shuffle, rank_drawn, rank_drawn_unchecked, split_sampler, split_uneven,
              split_replicas_differ, split_lengths_differ, same_lengths_end_together, structure_differs,
              pipeline_lengths_differ):
    try:
        res[check.__name__] = check()
    except Exception as e:  # noqa: BLE001 -- reported to the test
        res[check.__name__] = f"{type(e).__name__}: {e}"
        if not isinstance(e, ValueError):
            res[check.__name__] += traceback.format_exc()[-800:]
write_result(res)
