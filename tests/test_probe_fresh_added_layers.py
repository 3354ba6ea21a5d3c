"""A layer added to a model after ``ap.parallelize`` (a new classification head for fine-tuning): its parameters are
plain, not laid out. In the simulated world one object stands for every rank, so its gradient summed every rank's
part and training looked right; on launched ranks each rank's gradient is its own part only (no layout says over
which mesh dims to reduce it) and the copies drift apart, silently. ``step`` now refuses a plain parameter with
a gradient beside distributed ones, naming it and the remedy; the remedy (``ap.shard_layer(head, mesh)`` with the
model's mesh, then the optimizer) trains like one process under DP 4 and DP 2 x TP 2 (3 AdamW steps)."""
import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

import autoparallel as ap

XS = [np.random.default_rng(i).standard_normal((8, 8)).astype("float32") for i in range(3)]


class Body(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def _train(m, opt):
    losses = []
    for x in XS:
        loss = (m(paddle.to_tensor(x)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def _strategy(dp, tp):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    return s


def _parallel_body(dp, tp):
    paddle.seed(0)
    m = Body()
    kw = {"tp_plan": {"fc1": ap.ColWiseParallel()}} if tp > 1 else {}
    m, _ = ap.parallelize(m, None, strategy=_strategy(dp, tp), **kw)
    paddle.seed(1)
    m.fc2 = nn.Linear(8, 5)                  # the new head
    return m


@pytest.mark.parametrize("wrapped", [True, False])
def test_a_plain_head_beside_distributed_parameters_is_refused_by_name(wrapped):
    with ap.simulate(world_size=4):
        m = _parallel_body(4, 1)
        opt = paddle.optimizer.AdamW(0.05, parameters=m.parameters())
        opt = ap.shard_optimizer(opt) if wrapped else opt
        (m(paddle.to_tensor(XS[0])) ** 2).mean().backward()
        with pytest.raises(NotImplementedError, match=rf"{m.fc2.weight.name}.*not laid out.*ap.shard_layer"):
            opt.step()


@pytest.mark.parametrize("dp,tp", [(4, 1), (2, 2)])
def test_the_head_laid_out_with_the_models_mesh_trains_like_one_process(dp, tp):
    paddle.seed(0)
    ref = Body()
    paddle.seed(1)
    ref.fc2 = nn.Linear(8, 5)
    want = _train(ref, paddle.optimizer.AdamW(0.05, parameters=ref.parameters()))
    with ap.simulate(world_size=4):
        m = _parallel_body(dp, tp)
        ap.shard_layer(m.fc2, m.fc1.weight.mesh)
        got = _train(m, ap.shard_optimizer(paddle.optimizer.AdamW(0.05, parameters=m.parameters())))
        params = {n: p.full().numpy() for n, p in m.named_parameters()}
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(params[n], p.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)
