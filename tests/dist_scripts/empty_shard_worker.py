"""Runs on 4 ranks: parameters whose shard is empty on some rank (3 over 4 ranks: 1, 1, 1, 0).

Each case trains two steps (SGD, AdamW, SGD with ClipGradByGlobalNorm) and reports, per rank, whether ``p.grad``
was None after the first backward, its local shape, and every parameter's global value after the steps; the test
compares them with the same loop in one process (tests/test_empty_shard_grad_dist.py)."""
import numpy as np
import paddle

import autoparallel as ap
from autoparallel.testing.launch import write_result

RNG = np.random.default_rng(0)
XS = [RNG.standard_normal((8, 4)).astype("float32") for _ in range(2)]
OPTS = ("sgd", "adamw", "sgd_clip")
DISTS = ("shard_layer", "parallelize tp4", "parallelize zero3")


def make_opt(kind, params):
    if kind == "sgd":
        return paddle.optimizer.SGD(0.1, parameters=params)
    if kind == "adamw":
        return paddle.optimizer.AdamW(0.05, parameters=params)
    return paddle.optimizer.SGD(0.1, parameters=params, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5))


class Net(paddle.nn.Layer):
    """emb: Embedding(3, 4) (vocab split over 4 ranks), fc1: Linear(4, 3), its output dim split; scale [3]
    (split), written into a buffer with ``buf[:] = scale`` (paddle's set_value); fc2: Linear(3, 2), its input
    dim split."""
    def __init__(self):
        super().__init__()
        self.emb = paddle.nn.Embedding(3, 4)
        self.fc1, self.fc2 = paddle.nn.Linear(4, 3), paddle.nn.Linear(3, 2)
        self.scale = self.create_parameter([3], default_initializer=paddle.nn.initializer.Uniform(0.5, 1.5))

    def forward(self, x):
        ids = paddle.to_tensor([[0, 2, 1, 2, 0, 1, 1, 2]]).t()
        buf = paddle.ones([3])
        buf[:] = self.scale
        return self.fc2(paddle.tanh(self.fc1(x + self.emb(ids)[:, 0])) * buf)


def shard_fn(name, layer, mesh):
    if name == "":
        layer.scale = ap.shard_tensor(layer.scale, mesh, [ap.Shard(0)])
    if name == "fc1":
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(1)])
        layer.bias = ap.shard_tensor(layer.bias, mesh, [ap.Shard(0)])
    if name == "fc2":
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(0)])
    if name == "emb":
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(0)])


def build(kind, dist):
    paddle.seed(7)
    m = Net()
    if dist == "shard_layer":
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["mp"])
        m = ap.shard_layer(m, mesh, shard_fn)
        return m, ap.shard_optimizer(make_opt(kind, m.parameters())), mesh
    if dist.startswith("parallelize"):
        s = ap.Strategy()
        plan = None
        if dist == "parallelize tp4":
            s.tensor_parallel.degree = 4
            plan = {"emb": ap.VocabParallelEmbedding(), "fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()}
        else:
            s.data_parallel.degree, s.sharding.enable, s.sharding.stage = 4, True, 3
        opt = make_opt(kind, m.parameters())
        m, opt = ap.parallelize(m, opt, strategy=s, tp_plan=plan)
        return m, opt, None
    return m, make_opt(kind, m.parameters()), None


def train(kind, dist):
    m, opt, mesh = build(kind, dist)
    init = {n: np.asarray(p.full() if ap.is_dist(p) else p).tolist() for n, p in m.named_parameters()}
    first = None
    for x in XS:
        xin = paddle.to_tensor(x)
        if mesh is not None:
            xin = ap.shard_tensor(xin, mesh, [ap.Replicate()])
        out = m(xin)
        loss = (out * out).mean()
        loss.backward()
        if first is None:
            first = {n: _grad(p) for n, p in m.named_parameters()}
        opt.step()
        opt.clear_grad()
    full = {n: np.asarray(p.full() if ap.is_dist(p) else p).tolist() for n, p in m.named_parameters()}
    return {"grads": first, "params": full, "init": init, "loss": float(loss)}


def _write_sharded(p, mesh):
    t = ap.shard_tensor(paddle.zeros([3]), mesh, [ap.Shard(0)])
    t[0:3] = p
    return (t * t).sum()


def _write_plain(p, mesh):
    t = paddle.zeros([3])
    t[:] = p
    return (t * t).sum()


def _write_column(p, mesh):
    t = ap.shard_tensor(paddle.zeros([3, 2]), mesh, [ap.Shard(0)])
    t[:, 0] = p
    return (t * t).sum()


def _write_into_grad_tensor(p, mesh):
    t = ap.shard_tensor(paddle.ones([3]) * 2, mesh, [ap.Replicate()])
    t.stop_gradient = False
    t = t * 1.0
    t[0:3] = p
    return (t * t).sum()


WRITES = {"t[0:3] = p (t sharded)": _write_sharded, "t[:] = p (t plain)": _write_plain,
          "t[:, 0] = p (t [3, 2] sharded)": _write_column, "t[0:3] = p (t requires grad)": _write_into_grad_tensor}


def grad_forms():
    """p [3] split over 4 ranks (1, 1, 1, 0) written into another tensor: each rank's p.grad local shape."""
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["mp"])
    out = {}
    for name, f in WRITES.items():
        paddle.seed(3)
        p = ap.shard_tensor(paddle.create_parameter([3], "float32"), mesh, [ap.Shard(0)])
        f(p, mesh).backward()
        out[name] = None if p.grad is None else list(p.grad.shape)
    return out


def _grad(p):
    try:
        g = p.grad
    except NotImplementedError as e:            # ZeRO-3 keeps reduced gradients as chunks
        return ["refused", str(e)[:80]]
    return [g is None, None if g is None else list(g.shape)]


def main():
    out = {"grad_forms": grad_forms()}
    for dist in DISTS:
        for kind in OPTS:
            try:
                out[f"{dist}/{kind}"] = train(kind, dist)
            except Exception as e:          # reported per case: one crash does not hide the others
                out[f"{dist}/{kind}"] = f"{type(e).__name__}: {e}"[:500]
    write_result(out)


if __name__ == "__main__":
    ap.init_parallel_env()
    main()
