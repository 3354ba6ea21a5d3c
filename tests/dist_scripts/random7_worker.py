"""Runs on every rank (2 or 4) of a gloo job, each rank seeded differently (``paddle.seed(100 + rank)``, as a
script seeding per rank for its data augmentation does). Every check compares this rank's values with one process
seeded as the first rank (100), computed here on the same rank:

* ``ops``: random ops on distributed tensors (replicated and sharded): this rank's local value against the slice
  of the single-process draw, or (composites whose draw is not the plain op's) against the other ranks' values;
* ``after``: the generator after such a draw: the first rank's advanced as one process's, every other rank's own;
* ``params``: parameters laid out by ``shard_tensor`` (replicated and sharded), built eagerly or under
  ``paddle.LazyGuard``, against one full initialisation;
* ``training``: a tensor-parallel (and, on 4 ranks, DP x TP) MLP with dropout after the row-parallel layer,
  parameters built under the per-rank seeds, its losses against one process;
* ``llama`` (2 ranks): a PaddleFormers Llama with hidden and attention dropout under TP 2 and TP 2 + SP, built
  under the per-rank seeds, two training-mode forwards against one process.

    random7_worker.py            (2 or 4 ranks)
"""
import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

import autoparallel as ap
from autoparallel.lazy_init.params import materialize_params
from autoparallel.testing import paddleformers_models as pf
from autoparallel.testing.launch import write_result

SEED = 100
STEPS = 3


def local(t):
    from autoparallel.dist_tensor import is_dist

    if hasattr(t, "_ap_locals"):
        return next(iter(t._ap_locals.values())).numpy()
    return (t._local_value() if is_dist(t) else t).numpy()


def own_seed(rank):
    paddle.seed(SEED + rank)


def x_full():
    return paddle.to_tensor(np.random.default_rng(0).standard_normal((4, 6)).astype("float32"))


def image():
    return paddle.to_tensor(np.random.default_rng(1).standard_normal((4, 2, 6, 6)).astype("float32"))


# (name, op on a tensor, input builder, placements as a function of the mesh's ndim, compared with: "single" or
# "ranks")
OPS = [
    ("dropout", lambda x: F.dropout(x, 0.5), x_full, "R", "single"),
    ("dropout_s0", lambda x: F.dropout(x, 0.5), x_full, "S0", "single"),
    ("dropout_layer", lambda x: paddle.nn.Dropout(0.3)(x), x_full, "R", "single"),
    ("rand_like", lambda x: paddle.rand_like(x), x_full, "R", "single"),
    ("randn_like_s0", lambda x: paddle.randn_like(x), x_full, "S0", "single"),
    ("randint_like", lambda x: paddle.randint_like(x, 0, 10), x_full, "R", "single"),
    ("uniform_", lambda x: (x * 1.0).uniform_(-1.0, 1.0), x_full, "R", "single"),
    ("bernoulli", lambda x: paddle.bernoulli(F.sigmoid(x)), x_full, "R", "single"),
    ("normal", lambda x: paddle.normal(x, 1.0), x_full, "R", "single"),
    ("rrelu", lambda x: F.rrelu(x, training=True), x_full, "R", "single"),
    ("gumbel_softmax", lambda x: F.gumbel_softmax(x, 1.0), x_full, "R", "ranks"),
    ("fractional_max_pool2d", lambda x: F.fractional_max_pool2d(x, output_size=4), image, "R", "single"),
    ("svd_lowrank", lambda x: paddle.linalg.svd_lowrank(x, q=3)[1], x_full, "R", "ranks"),
]


def _placements(kind, ndim):
    first = ap.Shard(0) if kind == "S0" else ap.Replicate()
    return [first] + [ap.Replicate()] * (ndim - 1)


def _slice(full, spec_t):
    """This rank's part of ``full`` laid out as ``spec_t`` (a DistTensor)."""
    from autoparallel.comm.world import current_world

    spec = spec_t.spec if hasattr(spec_t, "spec") else spec_t._ap_spec
    coords = spec.mesh.coords_of(current_world().rank)
    return full[tuple(slice(*spec.local_range(coords, d)) for d in range(spec.ndim))]


def ops(rank, mesh):
    out = {}
    for name, op, make, kind, against in OPS:
        x = make()
        d = ap.shard_tensor(x, mesh, _placements(kind, mesh.ndim))
        own_seed(rank)
        mine = local(op(d))
        paddle.seed(SEED)
        ref = op(x).numpy()
        if against == "single":
            want = _slice(ref, d)
            out[name] = bool(mine.shape == want.shape and np.allclose(mine, want, atol=1e-6))
        else:
            out[name] = mine.tolist()
    return out


def after(rank, mesh):
    """The next plain draw after a dropout on a replicated tensor."""
    x = x_full()
    d = ap.shard_tensor(x, mesh, [ap.Replicate()] * mesh.ndim)
    own_seed(rank)
    F.dropout(d, 0.5)
    got = paddle.rand([5]).numpy()
    if rank == 0:
        paddle.seed(SEED)
        F.dropout(x, 0.5)
    else:
        own_seed(rank)
    return bool(np.array_equal(got, paddle.rand([5]).numpy()))


def params(rank, mesh):
    out = {}
    for kind, placements in (("R", [ap.Replicate()] * mesh.ndim),
                             ("S1", [ap.Shard(1)] + [ap.Replicate()] * (mesh.ndim - 1))):
        own_seed(rank)
        w = ap.shard_tensor(paddle.nn.Linear(6, 8).weight, mesh, placements)
        paddle.seed(SEED)
        full = paddle.nn.Linear(6, 8).weight.numpy()
        out[kind] = bool(np.array_equal(local(w), _slice(full, w)))
        own_seed(rank)
        with paddle.LazyGuard():
            lazy = paddle.nn.Linear(6, 8)
        w = ap.shard_tensor(lazy.weight, mesh, placements)
        materialize_params([w])
        out[kind + "_lazy"] = bool(np.array_equal(local(w), _slice(full, w)))
    return out


class MLP(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = paddle.nn.Linear(6, 16)
        self.fc2 = paddle.nn.Linear(16, 6)
        self.drop = paddle.nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(self.fc2(F.relu(self.fc1(x))))


def batch():
    rng = np.random.default_rng(5)
    return rng.standard_normal((4, 6)).astype("float32"), rng.standard_normal((4, 6)).astype("float32")


def _train(model, opt, shard=None):
    x, y = batch()
    x, y = paddle.to_tensor(x), paddle.to_tensor(y)
    if shard is not None:
        x, y = shard(x), shard(y)
    losses = []
    for _ in range(STEPS):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def training(rank, world):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = world // 2, 2
    own_seed(rank)
    m = MLP()
    m, opt = ap.parallelize(m, paddle.optimizer.SGD(0.1, parameters=m.parameters()), strategy=s,
                            tp_plan={"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()})
    got = _train(m, opt)
    paddle.seed(SEED)
    ref = MLP()
    want = _train(ref, paddle.optimizer.SGD(0.1, parameters=ref.parameters()))
    return {"got": got, "want": want}


TP_PLAN = {f"model.layers.*.{m}.{p}": ap.ColWiseParallel() for m, p in
           [("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("mlp", "gate_proj"),
            ("mlp", "up_proj")]}
TP_PLAN.update({"model.layers.*.self_attn.o_proj": ap.RowWiseParallel(),
                "model.layers.*.mlp.down_proj": ap.RowWiseParallel()})
DROPOUT = {"hidden_dropout_prob": 0.2, "attention_dropout": 0.2}


def _llama_losses(model):
    ids, labels = pf.batch(0)
    model.train()
    return [float(pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels))))
            for _ in range(2)]


def llama(rank, world):
    """PaddleFormers Llama with hidden and attention dropout under TP (and TP + SP), built under per-rank seeds."""
    out = {"want": _llama_losses(pf.build("llama", SEED, **DROPOUT))}
    for sp in (False, True):
        s = ap.Strategy()
        s.data_parallel.degree, s.tensor_parallel.degree = world // 2, 2
        s.sequence_parallel.enable = sp
        m, _ = ap.parallelize(pf.build("llama", SEED + rank, **DROPOUT), None, strategy=s, tp_plan=dict(TP_PLAN))
        out["tp_sp" if sp else "tp"] = _llama_losses(m)
    return out


def main():
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh1 = ap.ProcessMesh(list(range(world)), dim_names=["x"])
    res = {"rank": rank, "ops": ops(rank, mesh1), "after": after(rank, mesh1), "params": params(rank, mesh1)}
    if world == 4:
        mesh2 = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["a", "b"])
        res["ops2d"], res["params2d"] = ops(rank, mesh2), params(rank, mesh2)
    res["training"] = training(rank, world)
    if world == 2:
        res["llama"] = llama(rank, world)
    write_result(res)


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
