"""Runs on every rank (4, mesh 2x2): a batch that disagrees on some ranks only raises on every rank; reports
{check: result}."""
import traceback

import paddle

import autoparallel as ap
from autoparallel.testing.launch import write_result

world = ap.init_parallel_env()
RANK = world.rank
MESH = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])


def _batch(differ: bool):
    """Each rank's part (is_dataset_splitted=True, shard dim "data"): row k of the mesh loads part k; with
    ``differ`` the tensor-parallel replicas 2 and 3 get different labels (ranks 0 and 1 agree)."""
    row = MESH.coords_of(RANK)[0]
    ids = paddle.full([2, 3], float(row))
    labels = paddle.full([2, 1], float(RANK if differ and row == 1 else row))
    return [(ids, labels)]


def replicas_agree():
    """Every replica pair agrees: laid out, the global batch stacks the rows' parts."""
    ids, labels = next(iter(ap.shard_dataloader(_batch(False), MESH, shard_dims="data", is_dataset_splitted=True)))
    return [list(ids.full().shape), float(ids.full().sum()), float(labels.full().sum())]


def replicas_differ_on_one_row():
    """Ranks 2 and 3 disagree along "model", ranks 0 and 1 not: every rank raises; afterwards a collective over
    the whole mesh still pairs (ranks 0 and 1 went on into it alone before, and the watchdog ended the job)."""
    try:
        next(iter(ap.shard_dataloader(_batch(True), MESH, shard_dims="data", is_dataset_splitted=True)))
    except ValueError as e:
        x = ap.shard_tensor(paddle.ones([2, 2]), MESH, [ap.Shard(0), ap.Shard(1)])
        return [str(e), float(x.full().sum())]
    return ["no error"]


def key_missing_on_one_rank():
    """Rank 3's dict batch lacks "labels": it raised a KeyError alone while ranks 0-2 waited in the next
    collective. Every rank raises the ValueError naming the key; a collective over the whole mesh pairs after."""
    ids = paddle.full([2, 3], 1.0)
    batch = {"ids": ids} if RANK == 3 else {"ids": ids, "labels": ids}
    try:
        next(iter(ap.shard_dataloader([batch], MESH, input_keys=["ids", "labels"], shard_dims="data")))
    except ValueError as e:
        x = ap.shard_tensor(paddle.ones([2, 2]), MESH, [ap.Shard(0), ap.Shard(1)])
        return [str(e), float(x.full().sum())]
    return ["no error"]


res = {}
for check in (replicas_agree, replicas_differ_on_one_row, key_missing_on_one_rank):
    try:
        res[check.__name__] = check()
    except Exception as e:  # noqa: BLE001 -- reported to the test
        res[check.__name__] = f"{type(e).__name__}: {e}" + traceback.format_exc()[-800:]
write_result(res)
