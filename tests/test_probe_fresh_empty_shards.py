"""A dim split unevenly leaves a rank an empty shard (6 over 4 ranks: 2, 2, 2, 0), and paddle's CPU kernels
are not all right on it, against one process: ``paddle.bmm`` / ``paddle.baddbmm`` contracting an unevenly split
dim (the kernel left the empty rank's Partial term uninitialised: values of 1e+24 in the sum), and cross entropy
over logits whose 6 classes are split over 4 ranks (a classifier head under tensor parallelism: paddle refused
the max over the empty rank's classes) in the loss forms users write, trained 3 SGD steps."""
import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

import autoparallel as ap


def _x(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


PRODUCTS = {
    "bmm": lambda a, b: paddle.bmm(a.transpose([0, 2, 1]), b),
    "baddbmm": lambda a, b: paddle.baddbmm(paddle.ones([4, 8, 8]), a.transpose([0, 2, 1]), b, beta=0.5, alpha=2.0),
}


@pytest.mark.parametrize("name", sorted(PRODUCTS))
@pytest.mark.parametrize("b_split", [True, False])
def test_a_batched_product_over_an_uneven_contracted_dim(name, b_split):
    fn, a, b = PRODUCTS[name], _x((4, 6, 8), 0), _x((4, 6, 8), 1)
    ra, rb = paddle.to_tensor(a, stop_gradient=False), paddle.to_tensor(b, stop_gradient=False)
    out = fn(ra, rb)
    seed = paddle.to_tensor(_x(out.shape, 2))
    (out * seed).sum().backward()
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
        da = ap.shard_tensor(paddle.to_tensor(a, stop_gradient=False), mesh, [ap.Shard(1)])
        db = ap.shard_tensor(paddle.to_tensor(b, stop_gradient=False), mesh, [ap.Shard(1) if b_split else ap.Replicate()])
        assert [t.shape[1] for t in da.locals.values()] == [2, 2, 2, 0]
        o = fn(da, db)
        (o * seed).sum().backward()
        got, ga, gb = o.full().numpy(), da.grad.full().numpy(), db.grad.full().numpy()
    np.testing.assert_allclose(got, out.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ga, ra.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gb, rb.grad.numpy(), rtol=1e-5, atol=1e-5)


class Classifier(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 16), nn.Linear(16, 6)

    def forward(self, x):
        return self.head(F.gelu(self.fc(x)))


XS = [_x((8, 5, 8), i) for i in range(3)]
YS = [np.random.default_rng(i).integers(0, 6, (8, 5)) for i in range(3)]
WEIGHT = [1.0, 2.0, 0.5, 1.0, 3.0, 1.0]
LOSSES = {
    "mean": lambda lg, y: F.cross_entropy(lg, y),
    "ignored": lambda lg, y: F.cross_entropy(lg, paddle.where(y == 2, paddle.full_like(y, -100), y)),
    "weighted": lambda lg, y: F.cross_entropy(lg, y, weight=paddle.to_tensor(WEIGHT)),
    "smoothed": lambda lg, y: F.cross_entropy(lg, y, label_smoothing=0.1),
    "soft": lambda lg, y: F.cross_entropy(lg, F.one_hot(y, 6) * 0.9 + 0.1 / 6, soft_label=True),
    "layer": lambda lg, y: nn.CrossEntropyLoss()(lg, y),
}


def _train(model, opt, loss_fn):
    losses = []
    for x, y in zip(XS, YS):
        loss = loss_fn(model(paddle.to_tensor(x)), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("form", sorted(LOSSES))
def test_cross_entropy_over_six_classes_split_over_four_ranks(form):
    paddle.seed(0)
    ref = Classifier()
    want = _train(ref, paddle.optimizer.SGD(0.5, parameters=ref.parameters()), LOSSES[form])
    s = ap.Strategy()
    s.tensor_parallel.degree = 4
    paddle.seed(0)
    with ap.simulate(world_size=4):
        m = Classifier()
        m, opt = ap.parallelize(m, paddle.optimizer.SGD(0.5, parameters=m.parameters()), strategy=s,
                                tp_plan={"fc": ap.ColWiseParallel(), "head": ap.ColWiseParallel()})
        assert [t.shape[1] for t in m.head.weight.locals.values()] == [2, 2, 2, 0]
        got = _train(m, opt, LOSSES[form])
        params = {n: p.full().numpy() for n, p in m.named_parameters()}
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(params[n], p.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)
