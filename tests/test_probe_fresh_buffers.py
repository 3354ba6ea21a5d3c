"""A plain buffer updated from a distributed value, as users write a running statistic or an EMA of features:
``self.running.set_value(0.9 * self.running + 0.1 * h.mean(0))`` in the forward, ``buf.copy_(d)``. paddle raised
an AssertionError ("arguments type only support Variable, numpy, Tensor ...") / "must be Tensor, but got
DistTensor" on a distributed value; both now write its global value (gathered, a Partial reduced), as
``buf[:] = d`` and ``buf.add_(d)`` already did. Against one process: the forms one by one on a batch-split mean,
and a model with a running-mean buffer, a counter and a constant table trained 3 SGD steps under DP 4,
DP 2 x TP 2 and ZeRO-3 (losses, parameters, buffers, an eval forward). ``paddle.assign(d, output=plain)`` stays
refused by name."""
import numpy as np
import paddle
import paddle.nn as nn
import pytest

import autoparallel as ap

X = np.random.default_rng(0).standard_normal((8, 4)).astype("float32")
FORMS = {
    "set_value": lambda buf, v: buf.set_value(v),
    "set_value_expression": lambda buf, v: buf.set_value(buf * 0.9 + v * 0.1),
    "copy_": lambda buf, v: buf.copy_(v, False),
    "setitem": lambda buf, v: buf.__setitem__(slice(None), v),
    "add_": lambda buf, v: buf.add_(v),
}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("placement", ["S0", "R"])
def test_a_plain_buffer_takes_the_global_value(form, placement):
    want = paddle.full([4], 0.5)
    FORMS[form](want, paddle.to_tensor(X).mean(0))
    buf = paddle.full([4], 0.5)
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
        d = ap.shard_tensor(paddle.to_tensor(X), mesh, [ap.Shard(0) if placement == "S0" else ap.Replicate()])
        v = d.mean(0)
        assert v.placements == ([ap.Partial()] if placement == "S0" else [ap.Replicate()])
        FORMS[form](buf, v)
    assert not ap.is_dist(buf)
    np.testing.assert_allclose(buf.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)
    assert np.abs(want.numpy() - 0.5).max() > 0.05                # the value moved


def test_assign_into_a_plain_output_stays_refused_by_name():
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
        d = ap.shard_tensor(paddle.to_tensor(X), mesh, [ap.Shard(0)])
        with pytest.raises(NotImplementedError, match="gather it with .full"):
            paddle.assign(d, output=paddle.zeros([8, 4]))


class RunningMean(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 3)
        self.register_buffer("running", paddle.zeros([8]))
        self.register_buffer("count", paddle.zeros([1]), persistable=False)
        self.register_buffer("table", paddle.arange(8, dtype="float32") / 8)

    def forward(self, x):
        h = self.fc(x) + self.table
        if self.training:
            with paddle.no_grad():
                self.running.set_value(0.9 * self.running + 0.1 * h.mean(0))
                self.count += 1
        return self.out(h - self.running)


XS = [np.random.default_rng(i).standard_normal((8, 8)).astype("float32") for i in range(4)]


def _session(m, opt):
    losses = []
    for x in XS[:3]:
        loss = (m(paddle.to_tensor(x)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    m.eval()
    out = m(paddle.to_tensor(XS[3]))
    m.train()
    full = lambda t: t.full().numpy() if hasattr(t, "full") else t.numpy()  # noqa: E731
    return losses, full(out), {n: full(b) for n, b in m.named_buffers()}, {n: full(p) for n, p in m.named_parameters()}


@pytest.mark.parametrize("dp,tp,zero", [(4, 1, 0), (2, 2, 0), (4, 1, 3)])
def test_a_running_mean_buffer_trains_like_one_process(dp, tp, zero):
    paddle.seed(0)
    ref = RunningMean()
    want = _session(ref, paddle.optimizer.SGD(0.1, parameters=ref.parameters()))
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    s.sharding.enable, s.sharding.stage = zero > 0, max(zero, 1)
    paddle.seed(0)
    with ap.simulate(world_size=4):
        m = RunningMean()
        kw = {"tp_plan": {"fc": ap.ColWiseParallel()}} if tp > 1 else {}
        m, opt = ap.parallelize(m, paddle.optimizer.SGD(0.1, parameters=m.parameters()), strategy=s, **kw)
        got = _session(m, opt)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert set(got[2]) == {"running", "count", "table"}
    for n in want[2]:
        np.testing.assert_allclose(got[2][n], want[2][n], rtol=1e-5, atol=1e-7, err_msg=n)
    assert want[2]["count"][0] == 3.0 and np.abs(want[2]["running"]).max() > 0.01
    for n in want[3]:
        np.testing.assert_allclose(got[3][n], want[3][n], rtol=1e-4, atol=1e-6, err_msg=n)
