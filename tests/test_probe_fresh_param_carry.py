"""What a parameter carries to the distributed parameter replacing it when ``ap.parallelize`` lays it out.

Gradient hooks a user registers on parameters in a layer's ``__init__`` (``self.fc1.weight.register_hook(lambda
g: g * 0.1)``), before ``ap.parallelize`` lays the parameters out, against one process: DP, DP x TP, ZeRO-3 and
DP x TP x ZeRO-2 (SGD, 3 steps, losses and every parameter), beside a hook on an activation. Laying a parameter
out replaced it by a new parameter and the hooks stayed on the old one: training ran on unscaled gradients, no
error. The handle returned before parallelize still removes the hook afterwards.

Attributes users and model libraries set on parameters (``p.no_decay`` read by the user's own parameter-group
filter after parallelize, PaddleFormers-style ``p.color``) were lost the same way: the filter then read its
default and decayed every parameter. Parameters a layer keeps in its own list / dict / tuple attributes, and an
optimizer built after parallelize from a list of parameters taken before it, are pointed at the distributed
parameters (they named the originals, which no optimizer updates / which get no gradient)."""
import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

import autoparallel as ap

XS = [np.random.default_rng(i).standard_normal((8, 12)).astype("float32") for i in range(3)]
PLAN = {"fc1": "col", "fc2": "row"}


class Hooked(nn.Layer):
    def __init__(self, hooks=True):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(12, 16), nn.Linear(16, 12), nn.Linear(12, 3)
        self.handles = []
        if hooks:
            self.handles.append(self.fc1.weight.register_hook(lambda g: g * 0.1))
            self.handles.append(self.fc2.bias.register_hook(lambda g: g * 3.0))

    def forward(self, x):
        h = self.fc1(x)
        h.register_hook(lambda g: g * 2.0)
        return self.out(self.fc2(F.relu(h)))


def _train(model, opt, steps=3):
    losses = []
    for x in XS[:steps]:
        loss = (model(paddle.to_tensor(x)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def _one_process(hooks=True, remove=False):
    paddle.seed(0)
    m = Hooked(hooks)
    if remove:
        for h in m.handles:
            h.remove()
    losses = _train(m, paddle.optimizer.SGD(0.5, parameters=m.parameters()))
    return losses, {n: p.numpy() for n, p in m.named_parameters()}


def _parallel(dp, tp, zero, remove=False):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    if zero:
        s.sharding.enable, s.sharding.stage = True, zero
    styles = {"col": ap.ColWiseParallel(), "row": ap.RowWiseParallel()}
    kw = {"tp_plan": {k: styles[v] for k, v in PLAN.items()}} if tp > 1 else {}
    paddle.seed(0)
    with ap.simulate(world_size=4):
        m = Hooked()
        m, opt = ap.parallelize(m, paddle.optimizer.SGD(0.5, parameters=m.parameters()), strategy=s, **kw)
        if remove:
            assert all(h.remove() for h in m.handles)
        losses = _train(m, opt)
        return losses, {n: p.full().numpy() for n, p in m.named_parameters()}


def _assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for n, p in want[1].items():
        np.testing.assert_allclose(got[1][n], p, rtol=1e-4, atol=1e-6, err_msg=n)


@pytest.mark.parametrize("dp,tp,zero", [(4, 1, 0), (2, 2, 0), (4, 1, 3), (2, 2, 2)])
def test_hooks_registered_before_parallelize_act_as_in_one_process(dp, tp, zero):
    want = _one_process()
    _assert_same(_parallel(dp, tp, zero), want)
    unhooked = _one_process(hooks=False)       # the hooks matter: without them step 2 already differs
    assert abs(unhooked[0][1] - want[0][1]) > 1e-2


def test_the_handle_from_before_parallelize_removes_the_hook_after_it():
    want = _one_process(remove=True)
    _assert_same(_parallel(2, 2, 0, remove=True), want)


def test_a_hook_on_a_parameter_replaced_twice_still_fires():
    """shard_tensor of a parameter already laid out (another layout) keeps the hook too: g * 0.5 on w."""
    w = paddle.create_parameter([4, 2], "float32", default_initializer=nn.initializer.Constant(1.0))
    w.register_hook(lambda g: g * 0.5)
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        w1 = ap.shard_tensor(w, mesh, [ap.Shard(0)])
        w2 = ap.shard_tensor(w1, mesh, [ap.Shard(1)])
        (w2 * 3.0).sum().backward()
        grads = {r: t.grad.numpy() for r, t in w2.locals.items()}
    assert sorted(grads) == [0, 1]
    for g in grads.values():                     # each rank's column of the [4, 2] gradient: 3 * 0.5
        np.testing.assert_allclose(g, np.full((4, 1), 1.5, "float32"))


class Tagged(nn.Layer):
    """A layer tagging its parameters as users and model libraries do (``p.no_decay``, ``p.color``)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(12, 16), nn.Linear(16, 12), nn.Linear(12, 3)
        self.norm = nn.LayerNorm(12)
        for n, p in self.named_parameters():
            p.no_decay = n.endswith("bias") or n.startswith("norm")
        self.fc1.weight.color = {"color": "expert", "group": None}

    def forward(self, x):
        return self.out(self.norm(self.fc2(F.relu(self.fc1(x)))))


def _groups(model):
    """AdamW groups built from the tags after parallelize: weight decay 0.5 except on tagged parameters."""
    decay = [p for p in model.parameters() if not getattr(p, "no_decay", False)]
    plain = [p for p in model.parameters() if getattr(p, "no_decay", False)]
    return paddle.optimizer.AdamW(0.05, parameters=[{"params": decay}, {"params": plain, "weight_decay": 0.0}],
                                  weight_decay=0.5, epsilon=1e-4)


def _tagged_run(dp=1, tp=1):
    paddle.seed(0)
    if dp * tp == 1:
        m = Tagged()
        return _train(m, _groups(m)), {n: p.numpy() for n, p in m.named_parameters()}, m
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    kw = {"tp_plan": {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()}} if tp > 1 else {}
    with ap.simulate(world_size=4):
        m, _ = ap.parallelize(Tagged(), None, strategy=s, **kw)
        losses = _train(m, ap.shard_optimizer(_groups(m)))
        return losses, {n: p.full().numpy() for n, p in m.named_parameters()}, m


@pytest.mark.parametrize("dp,tp", [(4, 1), (2, 2)])
def test_attributes_set_on_parameters_survive_the_layout(dp, tp):
    want = _tagged_run()
    got = _tagged_run(dp, tp)
    tags = {n: getattr(p, "no_decay", None) for n, p in got[2].named_parameters()}
    assert tags == {n: p.no_decay for n, p in want[2].named_parameters()}
    assert sum(tags.values()) == 5                     # 3 biases, the norm's weight and bias
    assert got[2].fc1.weight.color == {"color": "expert", "group": None}
    assert ap.is_dist(got[2].fc1.weight)
    _assert_same(got[:2], want[:2])


class Listed(nn.Layer):
    """Parameters also held in the layer's own python containers: an L2 penalty over a list, a scale in a dict,
    a pair in a tuple."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 3)
        self.penalized = [self.fc1.weight, self.fc2.weight]
        self.cfg = {"scale": self.fc2.bias, "nested": {"pair": (self.fc1.bias, 2.0)}}

    def forward(self, x):
        out = self.fc2(F.relu(self.fc1(x))) * self.cfg["scale"]
        bias, k = self.cfg["nested"]["pair"]
        return out, sum((w * w).sum() for w in self.penalized) + k * (bias * bias).sum()


def _listed_run(dp=1, tp=1, zero=0):
    paddle.seed(0)
    m = Listed()
    opt = paddle.optimizer.SGD(0.3, parameters=m.parameters())
    if dp * tp > 1:
        s = ap.Strategy()
        s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
        s.sharding.enable, s.sharding.stage = zero > 0, max(zero, 1)
        kw = {"tp_plan": {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()}} if tp > 1 else {}
        with ap.simulate(world_size=4):
            m, opt = ap.parallelize(m, opt, strategy=s, **kw)
            assert m.penalized[0] is m.fc1.weight and m.cfg["nested"]["pair"][0] is m.fc1.bias
            return _listed_steps(m, opt), {n: p.full().numpy() for n, p in m.named_parameters()}
    return _listed_steps(m, opt), {n: p.numpy() for n, p in m.named_parameters()}


def _listed_steps(m, opt):
    losses = []
    for x in XS:
        out, reg = m(paddle.to_tensor(x))
        loss = (out ** 2).mean() + 1e-2 * reg
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("dp,tp,zero", [(4, 1, 0), (1, 4, 0), (4, 1, 3)])
def test_parameters_in_the_layers_own_containers_are_the_distributed_ones(dp, tp, zero):
    want = _listed_run()
    assert want[0][2] < want[0][0] - 1e-3          # the loss moves (the stale forward kept it at step 1's value)
    _assert_same(_listed_run(dp, tp, zero), want)


class Small(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def _groups_from(weights, others):
    return paddle.optimizer.AdamW(0.05, parameters=[{"params": weights}, {"params": others, "weight_decay": 0.0}])


def _small_losses(m, opt):
    losses = []
    for x in XS:
        loss = (m(paddle.to_tensor(x)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("wrapped", [True, False])
@pytest.mark.parametrize("dp,tp", [(4, 1), (2, 2)])
def test_an_optimizer_built_after_parallelize_from_parameters_taken_before(wrapped, dp, tp):
    """``weights = [p for n, p in model.named_parameters() if ...]`` before ``ap.parallelize(model, None)``, the
    optimizer after it (then ``ap.shard_optimizer`` or stepped as it is): it held the originals, which get no
    gradient, and the model did not follow one process (the plain one did not train at all)."""
    paddle.seed(0)
    ref = Small()
    want = _small_losses(ref, _groups_from([ref.fc1.weight, ref.fc2.weight], [ref.fc1.bias, ref.fc2.bias]))
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    paddle.seed(0)
    with ap.simulate(world_size=4):
        m = Small()
        weights = [p for n, p in m.named_parameters() if n.endswith("weight")]
        others = [p for n, p in m.named_parameters() if not n.endswith("weight")]
        kw = {"tp_plan": {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()}} if tp > 1 else {}
        m, _ = ap.parallelize(m, None, strategy=s, **kw)
        assert not any(ap.is_dist(p) for p in weights)          # the list still names the originals
        opt = _groups_from(weights, others)
        got = _small_losses(m, ap.shard_optimizer(opt) if wrapped else opt)
        params = {n: p.full().numpy() for n, p in m.named_parameters()}
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(params[n], p.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)


def test_an_optimizer_that_stepped_on_the_originals_is_refused_by_name():
    from autoparallel.parallel.stale_optimizers import StaleOptimizerError

    with ap.simulate(world_size=4):
        m = Small()
        opt = paddle.optimizer.AdamW(0.05, parameters=m.parameters())
        (m(paddle.to_tensor(XS[0])) ** 2).mean().backward()
        opt.step()                                               # state for the originals
        opt.clear_grad()
        s = ap.Strategy()
        s.data_parallel.degree = 4
        m, _ = ap.parallelize(m, None, strategy=s)
        (m(paddle.to_tensor(XS[1])) ** 2).mean().backward()
        with pytest.raises(StaleOptimizerError, match="build the optimizer from model.parameters"):
            opt.step()
