"""Debugging forms a user adds to a distributed model, against one process: ``h.retain_grads()`` on hidden
activations (batch-split under DP, column-split under TP, the Partial output of a row-parallel Linear) and a
logging hook returning None; after ``backward`` each ``h.grad`` equals one process's. ``retain_grads`` was refused
with "not an op and has no meaning for a distributed tensor"."""
import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

import autoparallel as ap

X = np.random.default_rng(0).standard_normal((8, 8)).astype("float32")


class Probed(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 3)
        self.kept, self.seen = {}, []

    def forward(self, x):
        h1 = self.fc1(x)
        h2 = self.fc2(F.relu(h1))
        for name, h in (("h1", h1), ("h2", h2)):
            h.retain_grads()
            self.kept[name] = h
        h2.register_hook(lambda g: self.seen.append(1))       # logging only: returns None
        return self.out(F.gelu(h2))


def _full(t):
    return t.full().numpy() if hasattr(t, "full") else t.numpy()


@pytest.mark.parametrize("dp,tp", [(4, 1), (1, 4), (2, 2)])
def test_retained_gradients_of_hidden_activations(dp, tp):
    paddle.seed(0)
    ref = Probed()
    (ref(paddle.to_tensor(X)) ** 2).mean().backward()
    want = {n: h.grad.numpy() for n, h in ref.kept.items()}
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    kw = {"tp_plan": {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()}} if tp > 1 else {}
    paddle.seed(0)
    with ap.simulate(world_size=4):
        m = Probed()
        m, _ = ap.parallelize(m, None, strategy=s, **kw)
        (m(paddle.to_tensor(X)) ** 2).mean().backward()
        placements = {n: list(h.placements) for n, h in m.kept.items()}
        got = {n: _full(h.grad) for n, h in m.kept.items()}
        calls = len(m.seen)
    if tp > 1:
        assert placements["h1"][-1] == ap.Shard(1)               # column-split
        assert isinstance(placements["h2"][-1], (ap.Partial, ap.Replicate))
    else:
        assert placements["h1"][0] == ap.Shard(0)                 # batch-split
    assert calls >= 1
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-5, atol=1e-7, err_msg=n)
        assert np.abs(want[n]).max() > 1e-4
