"""Runs on every rank (8, mesh 2x2x2): dtensor_from_local of a tensor dim split by two of three mesh dims, without
global_shape; reports {check: result}."""
import numpy as np
import paddle

import autoparallel as ap
from autoparallel.testing.launch import write_result

world = ap.init_parallel_env()
MESH = ap.ProcessMesh(np.arange(8).reshape(2, 2, 2).tolist(), dim_names=["a", "b", "c"])
PLACEMENTS = [ap.Shard(0), ap.Shard(0), ap.Replicate()]


def _part(sizes):
    """This rank's rows: chunk a * 2 + b of ``sizes``, filled with the chunk's index."""
    a, b, _ = MESH.coords_of(world.rank)
    k = a * 2 + b
    return paddle.full([sizes[k], 3], float(k))


def uneven_over_two_of_three_dims():
    """7 rows over a x b (4, 3 over "a", each over "b": 2, 2, 2, 1), replicated over "c": [7, 3] on every rank,
    the rows in chunk order. The ranks of one (a, b) sub-grid are no group of the mesh: the sizes are agreed
    over "a" then "b"."""
    x = ap.dtensor_from_local(_part([2, 2, 2, 1]), MESH, PLACEMENTS)
    return [list(x.shape), x.full().numpy()[:, 0].tolist()]


def not_a_layout_raises_everywhere():
    """Sizes 2, 2, 1, 2 are no ceil-division layout of 7: ValueError on every rank; a collective still pairs."""
    try:
        ap.dtensor_from_local(_part([2, 2, 1, 2]), MESH, PLACEMENTS)
    except ValueError as e:
        y = ap.shard_tensor(paddle.ones([8, 2]), MESH, [ap.Shard(0), ap.Replicate(), ap.Shard(1)])
        return [str(e), float(y.full().sum())]
    return ["no error"]


def per_rank_seeds_on_a_stage_sub_mesh():
    """Per-rank seeds on a pipeline stage's 2 x 2 sub-mesh of the 8 ranks (no group of its 4 ranks exists): a
    replicated parameter laid out there, and dropout on a replicated activation, agree over the sub-mesh's own
    dim groups with the sub-mesh's first rank; [param sum, dropout kept count, both equal on the sub-mesh]."""
    stages = [ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]),
              ap.ProcessMesh([[4, 5], [6, 7]], dim_names=["dp", "mp"])]
    mine = stages[0] if world.rank < 4 else stages[1]
    paddle.seed(100 + world.rank)
    w = paddle.create_parameter([4, 6], "float32")
    p = ap.shard_tensor(w, mine, [ap.Replicate(), ap.Replicate()])
    x = ap.shard_tensor(paddle.ones([8, 6]), mine, [ap.Replicate(), ap.Replicate()])
    kept = paddle.nn.functional.dropout(x, 0.5)
    vals = paddle.to_tensor(np.concatenate([p._ap_locals[world.rank].numpy().ravel(),
                                            kept._locals[world.rank].numpy().ravel()]))
    parts = []
    paddle.distributed.all_gather(parts, vals)
    group = range(4) if world.rank < 4 else range(4, 8)
    same = all(np.array_equal(parts[r].numpy(), parts[group[0]].numpy()) for r in group)
    return [float(vals.numpy()[:24].sum()), int((vals.numpy()[24:] != 0).sum()), same]


res = {}
for check in (uneven_over_two_of_three_dims, not_a_layout_raises_everywhere, per_rank_seeds_on_a_stage_sub_mesh):
    try:
        res[check.__name__] = check()
    except Exception as e:  # noqa: BLE001 -- reported to the test
        res[check.__name__] = [f"{type(e).__name__}: {e}"]
write_result(res)
