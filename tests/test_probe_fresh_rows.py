"""A row read from a tensor whose dim 0 is split (``x[i]``: the rank holding row i returns it, the others zeros,
a Partial(sum)) in code users write, against one process: a learned offset taken from a row of a vocab-split
embedding table (dp2 x tp2, tp4), ``kron`` / ``count_nonzero`` products with a row of a batch-split tensor.
The zeros of the ranks without the row were not joined to the input, so those ranks got no gradient: ``.grad``
read None and a collective downstream raised paddle's "backward function should return None" error. A
collective whose members' locals differ in needing a gradient (rank 0's computed from a parameter, the
others' constants) now passes None to the stopped ones."""
import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

import autoparallel as ap

RNG = np.random.default_rng(0)
BATCHES = [(RNG.integers(0, 16, (4, 5)), RNG.integers(0, 16, (4, 5))) for _ in range(3)]


class OffsetFromTable(nn.Layer):
    """Token embeddings plus row 3 of the same table as a learned offset."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return self.fc(self.emb(x) + self.emb.weight[3])


def _train(model, opt):
    losses = []
    for x, y in BATCHES:
        loss = F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def _full(t):
    return t.full().numpy() if hasattr(t, "full") else t.numpy()


@pytest.mark.parametrize("dp,tp,plan", [(2, 2, "emb+fc"), (1, 4, "emb")])
def test_a_row_of_a_vocab_split_table_trains_like_one_process(dp, tp, plan):
    paddle.seed(0)
    ref = OffsetFromTable()
    want = _train(ref, paddle.optimizer.SGD(0.5, parameters=ref.parameters()))
    styles = {"emb": ap.VocabParallelEmbedding(), "fc": ap.ColWiseParallel()}
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    paddle.seed(0)
    with ap.simulate(world_size=4):
        m = OffsetFromTable()
        m, opt = ap.parallelize(m, paddle.optimizer.SGD(0.5, parameters=m.parameters()), strategy=s,
                                tp_plan={k: styles[k] for k in plan.split("+")})
        assert m.emb.weight.placements[-1] == ap.Shard(0)          # the table is split by rows
        got = _train(m, opt)
        params = {n: _full(p) for n, p in m.named_parameters()}
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(params[n], p.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)


def _x(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


OPS = {
    "kron": lambda a: paddle.kron(a[0], a[1]),
    "count_nonzero": lambda a: paddle.count_nonzero(a > 0, axis=0).astype("float32") * a[0],
    "row_sum": lambda a: a[2].sum(0),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_a_row_of_a_batch_split_tensor_gives_one_process_gradient(name):
    fn, x = OPS[name], _x((4, 3, 5), 1)
    ref = paddle.to_tensor(x, stop_gradient=False)
    out = fn(ref)
    seed = _x(out.shape, 2)
    (out * paddle.to_tensor(seed)).sum().backward()
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
        d = ap.shard_tensor(paddle.to_tensor(x, stop_gradient=False), mesh, [ap.Shard(0)])
        o = fn(d)
        (o * paddle.to_tensor(seed)).sum().backward()
        assert all(t.grad is not None for t in d.locals.values())       # every rank's shard has a gradient
        got, grad = o.full().numpy(), d.grad.full().numpy()
    np.testing.assert_allclose(got, out.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, ref.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_a_row_of_an_inf_tensor_keeps_the_other_rows_gradient_zero():
    """The zeros are joined through an empty slice, not ``0 * x``: an inf elsewhere gives no nan."""
    x = _x((4, 3), 3)
    x[1, 0] = np.inf
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
        d = ap.shard_tensor(paddle.to_tensor(x, stop_gradient=False), mesh, [ap.Shard(0)])
        (d[2] * 3.0).sum().backward()
        grad = d.grad.full().numpy()
    want = np.zeros((4, 3), "float32")
    want[2] = 3.0
    np.testing.assert_array_equal(grad, want)


def test_a_collective_over_members_of_which_some_need_no_gradient():
    """Rank 0's term is 2w, the others' a constant 1: r = 2w + 3 after the all_reduce, d(sum r^2)/dw = 4r."""
    w = paddle.to_tensor([1.0, 2.0, 3.0], stop_gradient=False)
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
        locs = {r: (w * 2 if r == 0 else paddle.ones([3])) for r in range(4)}
        d = ap.dtensor_from_local(locs, mesh, [ap.Partial()])
        r = ap.reshard(d, mesh, [ap.Replicate()])
        (r * r).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), [20.0, 28.0, 36.0])
