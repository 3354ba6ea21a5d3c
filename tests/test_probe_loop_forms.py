"""Training-loop forms a paddle user writes around a distributed model (frozen parameters, ParamAttr,
unused branches, model.clear_gradients(), two forwards before one backward, ReduceOnPlateau(loss), reading
p.grad before the first step, a second backward through a retained graph): losses and every parameter
after several steps equal one process, in the simulated world, or the form is refused with a typed error."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as ap

RNG = np.random.default_rng(0)
XS = [RNG.standard_normal((8, 6)).astype("float32") for _ in range(6)]
YS = [RNG.standard_normal((8, 4)).astype("float32") for _ in range(6)]


class MLP(nn.Layer):
    def __init__(self, attr=None, branch=False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8, weight_attr=attr), nn.Linear(8, 4)
        self.side = nn.Linear(8, 4) if branch else None

    def forward(self, x, use_side=False):
        h = F.relu(self.fc1(x))
        return self.fc2(h) + self.side(h) if use_side else self.fc2(h)


def tp_fn(name, layer, mesh):
    if name == "fc1":
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Replicate(), ap.Shard(1)])
        layer.bias = ap.shard_tensor(layer.bias, mesh, [ap.Replicate(), ap.Shard(0)])
    if name == "fc2":
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Replicate(), ap.Shard(0)])


class One:
    """The single-process run."""
    def model(self, **kw):
        paddle.seed(3)
        return MLP(**kw)

    def wrap(self, m, opt):
        return m, opt

    def x(self, a):
        return paddle.to_tensor(a)


class Mesh2x2(One):
    """shard_layer on a [dp, mp] mesh (fc1/fc2 tensor parallel), shard_optimizer with an optional ZeRO stage."""
    def __init__(self, stage=None, tp=True):
        self.stage, self.tp = stage, tp

    def model(self, **kw):
        self.mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        return ap.shard_layer(super().model(**kw), self.mesh, tp_fn if self.tp else None)

    def wrap(self, m, opt):
        return m, ap.shard_optimizer(opt, None if self.stage is None else self.stage("dp", self.mesh))

    def x(self, a):
        return ap.shard_tensor(paddle.to_tensor(a), self.mesh, [ap.Shard(0), ap.Replicate()])


class Parallelize(One):
    """ap.parallelize with data parallel 4 (and a sharding stage)."""
    def __init__(self, stage=0):
        self.stage = stage

    def wrap(self, m, opt):
        s = ap.Strategy()
        s.data_parallel.degree = 4
        if self.stage:
            s.sharding.enable, s.sharding.stage = True, self.stage
        return ap.parallelize(m, opt, strategy=s)


RUNS = {"dp x tp": lambda: Mesh2x2(), "zero1": lambda: Mesh2x2(ap.ShardingStage1),
        "zero2": lambda: Mesh2x2(ap.ShardingStage2), "zero3": lambda: Mesh2x2(ap.ShardingStage3, tp=False),
        "parallelize dp": lambda: Parallelize(), "parallelize zero1": lambda: Parallelize(1),
        "parallelize zero3": lambda: Parallelize(3)}


def params(m):
    return {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in m.named_parameters()}


def train(env, make_opt, steps=3, model_kw=None, before_step=None, after_step=None, use_side=None, clear=None):
    m = env.model(**(model_kw or {}))
    m, opt = env.wrap(m, make_opt(m))
    losses = []
    for s in range(steps):
        if before_step:
            before_step(m, s)
        kw = {"use_side": use_side(s)} if use_side else {}
        loss = F.mse_loss(m(env.x(XS[s]), **kw), paddle.to_tensor(YS[s]))
        loss.backward()
        opt.step()
        (clear or (lambda m, o: o.clear_grad()))(m, opt)
        if after_step:
            after_step(m, s)
        losses.append(float(loss))
    return losses, params(m)


def both(run, probe, tol=1e-4):
    want = probe(One())
    with ap.simulate(world_size=4):
        got = probe(RUNS[run]())
    np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)
    for n, v in want[1].items():
        np.testing.assert_allclose(got[1][n], v, rtol=tol, atol=tol, err_msg=n)


# ---- ParamAttr(learning_rate=, regularizer=) and parameter groups ---------------------------------------------
def param_attr(env, attr=lambda: paddle.ParamAttr(learning_rate=3.0, regularizer=paddle.regularizer.L2Decay(0.5))):
    return train(env, lambda m: paddle.optimizer.Momentum(0.05, parameters=m.parameters()),
                 model_kw={"attr": attr()})


@pytest.mark.parametrize("run", ["dp x tp", "parallelize dp"])
def test_param_attr_regularizer_and_learning_rate_equal_one_process(run):
    both(run, param_attr)


def test_param_attr_regularizer_matters():
    """Negative control: the same run without the ParamAttr regularizer (what was trained) differs."""
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(param_attr(One())[0], param_attr(
            One(), attr=lambda: paddle.ParamAttr(learning_rate=3.0))[0], rtol=1e-4)


def groups_momentum(env):
    return train(env, lambda m: paddle.optimizer.Momentum(0.05, weight_decay=0.3, parameters=[
        {"params": [m.fc1.weight, m.fc1.bias], "learning_rate": 0.1, "weight_decay": 0.0},
        {"params": [m.fc2.weight, m.fc2.bias], "weight_decay": paddle.regularizer.L1Decay(0.2)}]))


def test_parameter_group_weight_decay_under_parallelize_equals_one_process():
    """paddle keeps a group's weight decay on its parameters (``param.regularizer``): it must survive the
    distributed parameter that parallelize puts in their place."""
    both("parallelize dp", groups_momentum)


# ---- frozen parameters --------------------------------------------------------------------------------------
def adamw(m):
    return paddle.optimizer.AdamW(0.05, parameters=m.parameters())


def freeze(m):
    m.fc1.bias.stop_gradient = True
    m.fc2.weight.stop_gradient = True


def frozen_before_wrapping(env):
    return train(env, lambda m: (freeze(m), adamw(m))[1])


def frozen_after_wrapping(env):
    return train(env, adamw, before_step=lambda m, s: freeze(m) if s == 0 else None)


def frozen_mid_run(env):
    def after(m, s):
        if s == 0:
            m.fc1.weight.stop_gradient = True
    return train(env, lambda m: paddle.optimizer.Momentum(0.05, parameters=m.parameters()), steps=4,
                 after_step=after)


def unfrozen_later(env):
    def after(m, s):
        if s == 1:
            m.fc1.weight.stop_gradient = False
    return train(env, lambda m: (setattr(m.fc1.weight, "stop_gradient", True), adamw(m))[1], steps=4,
                 after_step=after)


@pytest.mark.parametrize("run,probe", [
    ("dp x tp", frozen_before_wrapping), ("dp x tp", frozen_after_wrapping), ("dp x tp", frozen_mid_run),
    ("zero1", frozen_after_wrapping), ("zero1", frozen_mid_run), ("zero1", unfrozen_later),
    ("parallelize zero3", frozen_after_wrapping), ("parallelize zero3", unfrozen_later)])
def test_frozen_parameters_equal_one_process(run, probe):
    both(run, probe)


def test_freezing_matters():
    """Negative control: freezing mid-run changes the single-process result."""
    plain = train(One(), lambda m: paddle.optimizer.Momentum(0.05, parameters=m.parameters()), steps=4)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(frozen_mid_run(One())[1]["fc1.weight"], plain[1]["fc1.weight"], rtol=1e-4)


# ---- a branch unused in some steps, model.clear_gradients(), two forwards -----------------------------------
def unused_branch(env, set_to_zero=True):
    return train(env, lambda m: paddle.optimizer.Momentum(0.05, parameters=m.parameters()), steps=4,
                 model_kw={"branch": True}, use_side=lambda s: s == 1,
                 clear=lambda m, o: o.clear_grad(set_to_zero=set_to_zero))


@pytest.mark.parametrize("run", ["zero2", "parallelize zero3"])
def test_a_branch_unused_in_a_step_moves_as_in_one_process(run):
    """paddle's clear_grad() keeps a zero gradient and the optimizer steps it (momentum moves the branch)."""
    both(run, unused_branch)


def test_unused_branch_zero_gradient_matters():
    """Negative control: dropping the gradients instead (set_to_zero=False) gives another branch."""
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(unused_branch(One())[1]["side.weight"],
                                   unused_branch(One(), set_to_zero=False)[1]["side.weight"], rtol=1e-4)


def model_clear_gradients(env):
    m = env.model()
    m, opt = env.wrap(m, paddle.optimizer.Adam(0.05, parameters=m.parameters()))
    losses = []
    for s in range(3):
        for k in range(2):
            loss = F.mse_loss(m(env.x(XS[2 * k])), paddle.to_tensor(YS[2 * k])) / 2
            loss.backward()
        opt.step()
        m.clear_gradients()
        losses.append(float(loss))
    return losses, params(m)


@pytest.mark.parametrize("run", ["dp x tp", "zero1"])
def test_accumulation_cleared_by_model_clear_gradients_equals_one_process(run):
    both(run, model_clear_gradients)


def two_forwards(env):
    m = env.model()
    m, opt = env.wrap(m, paddle.optimizer.Adam(0.05, parameters=m.parameters()))
    losses = []
    for s in range(3):
        l1 = F.mse_loss(m(env.x(XS[s])), paddle.to_tensor(YS[s]))
        l2 = F.mse_loss(m(env.x(XS[s + 3])), paddle.to_tensor(YS[s + 3]))
        paddle.autograd.backward([l1, l2 * 0.5]) if s % 2 else (l1 + l2 * 0.5).backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(l1))
    return losses, params(m)


@pytest.mark.parametrize("run", ["zero3", "parallelize zero3"])
def test_two_forwards_before_one_backward_under_zero3_equal_one_process(run):
    both(run, two_forwards)


# ---- LR on plateau, p.grad before the first step, a retained graph -------------------------------------------
def plateau(env):
    m = env.model()
    sch = paddle.optimizer.lr.ReduceOnPlateau(0.1, patience=0, factor=0.5)
    m, opt = env.wrap(m, paddle.optimizer.Adam(sch, parameters=m.parameters()))
    out = []
    for s in range(4):
        loss = F.mse_loss(m(env.x(XS[0 if s < 2 else 5])), paddle.to_tensor(YS[0 if s < 2 else 5]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        sch.step(loss)
        out += [float(loss), opt.get_lr()]
    return out, params(m)


def test_reduce_on_plateau_with_the_distributed_loss_equals_one_process():
    both("dp x tp", plateau)
    assert plateau(One())[0][-1] < 0.1                      # the schedule did lower the learning rate


def first_grads(env):
    m = env.model()
    m, opt = env.wrap(m, paddle.optimizer.SGD(0.05, parameters=m.parameters()))
    F.mse_loss(m(env.x(XS[0])), paddle.to_tensor(YS[0])).backward()
    return [float(p.grad.abs().sum()) for p in m.parameters()], params(m)


@pytest.mark.parametrize("run", ["parallelize dp", "parallelize zero1"])
def test_gradients_read_before_the_first_step_are_reduced(run):
    """Data parallel: backward already sums the gradients over the data ranks on the very first step."""
    both(run, first_grads)


def test_gradients_read_before_the_first_step_negative_control(monkeypatch):
    """Without planning the buckets as the first backward starts, p.grad holds this rank's partial sum."""
    monkeypatch.setattr("autoparallel.parallel.grads.GradientSync.before_backward", lambda self, ts=(): False)
    with pytest.raises(AssertionError):
        both("parallelize dp", first_grads)


def retained(env):
    m = env.model()
    m, opt = env.wrap(m, paddle.optimizer.SGD(0.05, parameters=m.parameters()))
    loss = F.mse_loss(m(env.x(XS[0])), paddle.to_tensor(YS[0]))
    loss.backward(retain_graph=True)
    loss.backward()
    opt.step()
    return [float(loss)], params(m)


def test_a_second_backward_through_collectives_is_refused():
    """paddle 3.3 kills the process re-running a PyLayer's backward (every collective is one): refused."""
    with ap.simulate(world_size=4), pytest.raises(NotImplementedError, match="retain_graph=True.*PyLayer"):
        retained(Mesh2x2())


def test_a_second_backward_without_collectives_runs():
    both("parallelize dp", retained)


# ---- paddle.nn.utils clips called by hand between backward and step --------------------------------------------
def hand_clip(clip):
    def probe(env):
        m = env.model()
        m, opt = env.wrap(m, paddle.optimizer.Momentum(0.05, parameters=m.parameters()))
        out = []
        for s in range(3):
            loss = F.mse_loss(m(env.x(XS[s])), paddle.to_tensor(YS[s]))
            loss.backward()
            out.append(clip(m))
            opt.step()
            opt.clear_grad()
            out.append(float(loss))
        return out, params(m)
    return probe


CLIPS = {"norm": lambda m: float(paddle.nn.utils.clip_grad_norm_(m.parameters(), 0.05)),
         "inf norm": lambda m: float(paddle.nn.utils.clip_grad_norm_(m.parameters(), 0.02, norm_type=float("inf"))),
         "value": lambda m: paddle.nn.utils.clip_grad_value_(m.parameters(), 0.01) or 0.0}


@pytest.mark.parametrize("run,clip", [("dp x tp", "norm"), ("dp x tp", "inf norm"), ("parallelize dp", "value"),
                                      ("parallelize dp", "norm")])
def test_clips_by_hand_equal_one_process(run, clip):
    """The data-parallel gradients are reduced first, the norm is the whole gradients' (returned too)."""
    both(run, hand_clip(CLIPS[clip]))


def test_clips_by_hand_negative_control():
    """The clip matters: the run without it differs."""
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(hand_clip(CLIPS["norm"])(One())[1]["fc1.weight"],
                                   hand_clip(lambda m: 0.0)(One())[1]["fc1.weight"], rtol=1e-4)


def test_clip_by_hand_under_zero_is_refused():
    with ap.simulate(world_size=4), pytest.raises(NotImplementedError, match="clip_grad_norm_.*ZeRO.*grad_clip"):
        hand_clip(CLIPS["norm"])(Mesh2x2(ap.ShardingStage2))


# ---- the optimizer's grad_clip under ZeRO ---------------------------------------------------------------------
def zero_clip(clip):
    return lambda env: train(env, lambda m: paddle.optimizer.Momentum(0.05, parameters=m.parameters(),
                                                                      grad_clip=clip()))


@pytest.mark.parametrize("run,clip", [("zero2", lambda: nn.ClipGradByNorm(0.05)),
                                      ("parallelize zero3", lambda: nn.ClipGradByNorm(0.05)),
                                      ("zero1", lambda: nn.ClipGradByValue(0.01)),
                                      ("parallelize zero3", lambda: nn.ClipGradByValue(0.01))])
def test_per_parameter_and_value_clips_under_zero_equal_one_process(run, clip):
    """ClipGradByNorm by each parameter's whole gradient norm over its chunks; ClipGradByValue on the chunks."""
    both(run, zero_clip(clip))


def test_zero_clip_negative_control():
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(zero_clip(lambda: nn.ClipGradByNorm(0.05))(One())[1]["fc1.weight"],
                                   zero_clip(lambda: None)(One())[1]["fc1.weight"], rtol=1e-4)


# ---- values written into parameters mid-run (set_value, set_state_dict, in-place fills) -------------------------
def written(env):
    m = env.model()
    m, opt = env.wrap(m, paddle.optimizer.Momentum(0.05, parameters=m.parameters()))
    losses = []
    for s in range(4):
        loss = F.mse_loss(m(env.x(XS[s])), paddle.to_tensor(YS[s]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
        if s == 0:
            m.fc1.weight.set_value(paddle.full([6, 8], 0.1))
            with paddle.no_grad():
                m.fc2.bias.zero_()
                paddle.seed(7)
                m.fc2.weight.normal_(0, 0.1)
        if s == 1:
            m.set_state_dict({"fc1.bias": paddle.full([8], 0.2)})
    return losses, params(m)


@pytest.mark.parametrize("run", ["zero1", "zero2", "parallelize zero3"])
def test_values_written_into_parameters_under_zero_are_trained_on(run):
    """The next step starts from the written values (the master chunks take them) instead of writing the old
    master weights back over them; a released ZeRO-3 parameter is gathered for the write."""
    both(run, written)


def test_values_written_negative_control(monkeypatch):
    monkeypatch.setattr("autoparallel.parallel.sharding.ZeroOptimizer.reload", lambda self, params: None)
    with pytest.raises(AssertionError):
        both("zero2", written)


def test_reading_p_grad_under_zero2_names_the_chunks():
    """From the second step on ZeRO-2 reduce-scatters during backward: p.grad is refused with a typed error
    naming the optimizer's grad_clip and stage 1, not paddle's AttributeError on None."""
    with ap.simulate(world_size=4):
        env = Mesh2x2(ap.ShardingStage2)
        m = env.model()
        m, opt = env.wrap(m, paddle.optimizer.SGD(0.05, parameters=m.parameters()))
        for s in range(2):
            F.mse_loss(m(env.x(XS[s])), paddle.to_tensor(YS[s])).backward()
            if s == 1:
                with pytest.raises(NotImplementedError, match="ZeRO stage 2.*chunks.*grad_clip.*stage 1"):
                    m.fc1.weight.grad.norm()
            opt.step()
            opt.clear_grad()
        assert m.fc1.weight.grad is None                       # between steps: paddle's None
