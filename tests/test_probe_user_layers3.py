"""User code inside column-parallel layers under sequence parallelism (a PyLayer, local code, a replicated op
reading the gathered input), ``paddle.metric`` on distributed logits and complex reductions to a split layout in
the simulated world: each equals one process (values and gradients)."""
import numpy as np
import paddle
import pytest
from paddle.autograd import PyLayer

import autoparallel as ap
from autoparallel.comm.world import current_world
from autoparallel.dist_tensor import is_dist
from autoparallel.parallel.tensor_parallel import ColWiseParallel, RowWiseParallel, SequenceParallel


def _np(t):
    return t.full().numpy() if is_dist(t) else t.numpy()


def _grad(p):
    return _np(p.as_dist().grad) if hasattr(p, "as_dist") else p.grad.numpy()


# ---- user code reading the input a column-parallel layer gathers under sequence parallelism ----------------------
class _MatMul(PyLayer):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return paddle.matmul(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensor()
        gw = paddle.matmul(x.reshape([-1, x.shape[-1]]), g.reshape([-1, g.shape[-1]]), transpose_x=True)
        return paddle.matmul(g, w, transpose_y=True), gw


class _Double(ap.LocalLayer):
    def forward(self, t):
        return t * 2.0


def _to_local_twice(x):
    """dtensor_to_local / dtensor_from_local as every rank of a launched job runs them."""
    world, locs = current_world(), {}
    try:
        for r in sorted(x._locals):
            world.rank = r
            locs[r] = ap.dtensor_to_local(x) * 2.0
    finally:
        world.rank = 0
    return ap.dtensor_from_local(locs, x.mesh, list(x.placements))


def _twice(x):
    return x * 2.0


_READERS = {            # name: (the reader on a distributed input, the same on a plain one)
    "pylayer": (None, None),
    "scale": (_twice, _twice),
    "relu": (lambda x: paddle.nn.functional.relu(x), lambda x: paddle.nn.functional.relu(x)),
    "local_map": (lambda x: ap.local_map(_twice, out_placements=[list(x.placements)])(x), _twice),
    "local_layer": (lambda x: _Double([(x.mesh, list(x.placements))], [None])(x), _twice),
    "to_local": (_to_local_twice, _twice),
    "reshard": (lambda x: ap.reshard(x, x.mesh, [ap.Replicate()] * (x.mesh.ndim - 1) + [ap.Shard(0)]), lambda x: x),
    "full": (lambda x: x.full() * 2.0, _twice),
}


class _Up(paddle.nn.Linear):
    reader = "pylayer"

    def forward(self, x):
        if self.reader == "pylayer":
            return _MatMul.apply(x, self.weight) + self.bias
        return super().forward(_READERS[self.reader][0 if is_dist(x) else 1](x))


class _Net(paddle.nn.Layer):
    def __init__(self, reader):
        super().__init__()
        self.emb = paddle.nn.Linear(8, 8)
        self.norm = paddle.nn.LayerNorm(8)
        self.up = _Up(8, 16)
        self.up.reader = reader
        self.down = paddle.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(paddle.nn.functional.relu(self.up(self.norm(self.emb(x))))).square().mean()


def _train_once(reader, dp=0, tp=0):
    paddle.seed(0)
    net = _Net(reader)
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((4, 6, 8)).astype("float32"))
    if tp:
        s = ap.Strategy()
        s.data_parallel.degree, s.tensor_parallel.degree, s.sequence_parallel.enable = dp, tp, True
        plan = {"up": ColWiseParallel(), "down": RowWiseParallel(), "norm": SequenceParallel()}
        net, _ = ap.parallelize(net, paddle.optimizer.SGD(0.1, parameters=net.parameters()), strategy=s,
                                tp_plan=plan)
    loss = net(x)
    loss.backward()
    return [_np(loss)] + [_grad(p) for p in (net.emb.weight, net.norm.weight, net.up.weight, net.up.bias)]


@pytest.mark.parametrize("reader,dp,tp", [("pylayer", 1, 4), ("pylayer", 2, 2), ("scale", 1, 4), ("relu", 2, 2),
                                          ("local_map", 1, 4), ("local_layer", 1, 2), ("to_local", 1, 4),
                                          ("reshard", 2, 2), ("full", 1, 4), ("full", 2, 2)])
def test_reader_of_the_gathered_input_gives_one_process_gradients(reader, dp, tp):
    ref = _train_once(reader)
    with ap.simulate(world_size=dp * tp):
        got = _train_once(reader, dp, tp)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)


def test_paddle_grad_of_the_gathered_input_is_partial_on_the_tp_dim():
    from autoparallel import autograd_forms
    from autoparallel.comm import fanout

    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1])
        x = ap.shard_tensor(paddle.randn([4, 3]), mesh, [ap.Shard(0)])
        x.stop_gradient = False
        y = fanout.replicate_for_split(x, 0)
        assert autograd_forms._partial_dims(y) == frozenset({0})
        assert autograd_forms._partial_dims(fanout.complete_gradient(y)) == frozenset()


# ---- paddle.metric on distributed logits ---------------------------------------------------------------------------
_RNG = np.random.default_rng(0)
_LOGITS = _RNG.standard_normal((8, 16)).astype("float32")
_LABELS = _RNG.integers(0, 16, (8, 1)).astype("int64")


def _accuracy(x, y, k):
    correct, total = paddle.zeros([1], "int64"), paddle.zeros([1], "int32")
    acc = paddle.metric.accuracy(x, y, k=k, correct=correct, total=total)
    return float(_np(acc)), _np(acc).dtype, int(correct), int(total), list(correct.shape), correct.dtype


@pytest.mark.parametrize("xp,yp", [("S0,S1", "S0,R"), ("S0,R", "R,R"), ("R,S1", "R,R"), ("R,R", "S0,R"),
                                   ("S1,R", "R,S0")])
@pytest.mark.parametrize("k", [1, 5])
def test_accuracy_on_distributed_logits_equals_one_process(xp, yp, k):
    def places(text):
        return [ap.Replicate() if p == "R" else ap.Shard(int(p[1])) for p in text.split(",")]

    x, y = paddle.to_tensor(_LOGITS), paddle.to_tensor(_LABELS)
    ref = _accuracy(x, y, k)
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
        got = _accuracy(ap.shard_tensor(x, mesh, places(xp)), ap.shard_tensor(y, mesh, places(yp)), k)
    assert got == ref


def test_accuracy_refuses_what_paddle_refuses_by_name():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1])
        x = ap.shard_tensor(paddle.to_tensor(_LOGITS), mesh, [ap.Shard(1)])
        y = paddle.to_tensor(_LABELS)
        with pytest.raises(ValueError, match="label must be"):
            paddle.metric.accuracy(x, y.reshape([-1]))
        with pytest.raises(ValueError, match="k must be"):
            paddle.metric.accuracy(x, y, k=17)
        with pytest.raises(TypeError, match="int32 or int64"):
            paddle.metric.accuracy(x, y.astype("float32"))


def _metric_states(x, y):
    acc = paddle.metric.Accuracy(topk=(1, 3))
    step = acc.update(acc.compute(x, y))
    out = [step, acc.accumulate()]
    prob = paddle.nn.functional.sigmoid(x[:, :1])
    for m in (paddle.metric.Precision(), paddle.metric.Recall()):
        m.update(prob, y % 2)
        out.append(m.accumulate())
    auc = paddle.metric.Auc()
    auc.update(paddle.nn.functional.softmax(x[:, :2]), y % 2)
    return out + [auc.accumulate()]


def test_metric_classes_on_distributed_tensors_equal_one_process():
    x, y = paddle.to_tensor(_LOGITS), paddle.to_tensor(_LABELS)
    ref = _metric_states(x, y)
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
        got = _metric_states(ap.shard_tensor(x, mesh, [ap.Shard(0), ap.Shard(1)]),
                             ap.shard_tensor(y, mesh, [ap.Shard(0), ap.Replicate()]))
    assert got == ref


# ---- complex tensors reduced to a split layout in the simulated world ----------------------------------------------
def test_complex_partial_resharded_to_a_shard_equals_its_sum():
    a = np.random.default_rng(1).standard_normal((4, 7, 6)).astype("float32")
    parts = {r: paddle.complex(paddle.to_tensor(a[r]), paddle.to_tensor(a[r] ** 2)) for r in range(4)}
    total = sum(p.numpy() for p in parts.values())
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3])
        for axis in (0, 1, -1):
            got = ap.reshard(ap.dtensor_from_local(dict(parts), mesh, [ap.Partial()]), mesh, [ap.Shard(axis)])
            np.testing.assert_allclose(got.full().numpy(), total, rtol=1e-5, atol=1e-6)


def _complex_matmul(a, b, mesh=None):
    A, B = paddle.to_tensor(a, stop_gradient=False), paddle.to_tensor(b, stop_gradient=False)
    if mesh is not None:
        A, B = ap.shard_tensor(A, mesh, [ap.Shard(1)]), ap.shard_tensor(B, mesh, [ap.Shard(0)])
        A.stop_gradient = B.stop_gradient = False
    z = paddle.complex(A, A) @ paddle.complex(B, B)          # the inner dim split: a Partial product
    if mesh is not None:
        z = ap.reshard(z, mesh, [ap.Shard(0)])
    loss = paddle.abs(z).sum()
    loss.backward()
    return [_np(z), _np(loss), _np(A.grad), _np(B.grad)]


def test_complex_matmul_with_the_inner_dim_split_equals_one_process():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((7, 8)).astype("float32"), rng.standard_normal((8, 5)).astype("float32")
    ref = _complex_matmul(a, b)
    with ap.simulate(world_size=4):
        got = _complex_matmul(a, b, ap.ProcessMesh([0, 1, 2, 3]))
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_accuracy_on_uneven_and_partial_logits_equals_one_process():
    rng = np.random.default_rng(3)
    logits, labels = rng.standard_normal((7, 15)).astype("float32"), rng.integers(0, 15, (7, 1)).astype("int64")
    ref = [float(paddle.metric.accuracy(paddle.to_tensor(logits), paddle.to_tensor(labels), k=k)) for k in (1, 4)]
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]])
        y = ap.shard_tensor(paddle.to_tensor(labels), mesh, [ap.Shard(0), ap.Replicate()])
        parts = ap.dtensor_from_local({r: paddle.to_tensor(logits / 4) for r in range(4)}, mesh,
                                      [ap.Partial(), ap.Partial()])
        for x in (ap.shard_tensor(paddle.to_tensor(logits), mesh, [ap.Shard(0), ap.Shard(1)]),
                  ap.reshard(parts, mesh, [ap.Partial(), ap.Shard(1)])):
            assert [float(paddle.metric.accuracy(x, y, k=k)) for k in (1, 4)] == ref
