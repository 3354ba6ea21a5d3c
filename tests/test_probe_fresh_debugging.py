"""Debugging and tensor-method forms a user writes on distributed tensors, against one process:
``h.retain_grads()`` on hidden activations (batch-split under DP, column-split under TP, the Partial output of a row-parallel Linear) and a
logging hook returning None; after ``backward`` each ``h.grad`` equals one process's. ``retain_grads`` was refused
with "not an op and has no meaning for a distributed tensor", and so were ``x.repeat`` / ``x.split_with_sizes``
(written by paddle in python over tile / slice), ``requires_grad`` / ``requires_grad_()``, ``gradient()`` and the
in-place ``detach_()`` of truncated backpropagation through time (a GRU state cut between windows, DP 4)."""
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


Y = np.random.default_rng(1).standard_normal((4, 6)).astype("float32")
FORMS = {
    "repeat": lambda t: t.repeat(2, 3),
    "split_with_sizes_dim1": lambda t: t.split_with_sizes([1, 2, 3], dim=1)[1] * 1.0,
    "split_with_sizes_dim0": lambda t: t.split_with_sizes([3, 1], dim=0)[0] * 1.0,
}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("dim", [0, 1])
def test_tensor_methods_paddle_writes_in_python(form, dim):
    """``x.repeat`` (paddle's tile), ``x.split_with_sizes``: refused as "not an op", now run as paddle wrote them."""
    ref = paddle.to_tensor(Y, stop_gradient=False)
    out = FORMS[form](ref)
    weight = paddle.to_tensor(np.random.default_rng(2).standard_normal(out.shape).astype("float32"))
    (out * weight).sum().backward()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        d = ap.shard_tensor(paddle.to_tensor(Y, stop_gradient=False), mesh, [ap.Shard(dim)])
        o = FORMS[form](d)
        (o * weight).sum().backward()
        got, grad = o.full().numpy(), d.grad.full().numpy()
    np.testing.assert_array_equal(got, out.numpy())
    np.testing.assert_array_equal(grad, ref.grad.numpy())


def test_requires_grad_and_gradient():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        d = ap.shard_tensor(paddle.to_tensor(Y), mesh, [ap.Shard(0)])
        assert d.requires_grad is False
        assert d.requires_grad_() is d and d.requires_grad and not d.stop_gradient
        d.requires_grad = False
        assert d.stop_gradient
        assert d.gradient() is None
        d.requires_grad_(True)
        (d * 2.0).sum().backward()
        g = d.gradient()
    assert isinstance(g, np.ndarray) and g.shape == (4, 6)
    np.testing.assert_array_equal(g, np.full((4, 6), 2.0, "float32"))


class Recurrent(nn.Layer):
    def __init__(self):
        super().__init__()
        self.cell, self.out = nn.GRUCell(6, 8), nn.Linear(8, 2)

    def forward(self, x, h):
        outs = []
        for t in range(x.shape[1]):
            y, h = self.cell(x[:, t], h)
            outs.append(self.out(y))
        return paddle.stack(outs, 1), h


WINDOWS = [np.random.default_rng(i).standard_normal((4, 5, 6)).astype("float32") for i in range(3)]


def _bptt(m, opt):
    h, losses = paddle.zeros([4, 8]), []
    for x in WINDOWS:
        y, h = m(paddle.to_tensor(x), h)
        loss = (y ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
        assert h.detach_() is h and h.stop_gradient          # the state is cut between windows
    return losses


def test_truncated_bptt_cuts_the_state_with_detach_():
    """A GRU cell's state carried across windows and cut in place with ``h.detach_()`` (refused as "not an op"),
    data parallel over 4, 3 SGD steps: the losses and every parameter equal one process."""
    paddle.seed(0)
    ref = Recurrent()
    want = _bptt(ref, paddle.optimizer.SGD(0.3, parameters=ref.parameters()))
    s = ap.Strategy()
    s.data_parallel.degree = 4
    paddle.seed(0)
    with ap.simulate(world_size=4):
        m = Recurrent()
        m, opt = ap.parallelize(m, paddle.optimizer.SGD(0.3, parameters=m.parameters()), strategy=s)
        got = _bptt(m, opt)
        params = {n: _full(p) for n, p in m.named_parameters()}
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(params[n], p.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)
