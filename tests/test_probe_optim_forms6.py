"""Optimizer, clip and weight-decay forms over distributed models against one process (losses, learning rates and
every parameter after 3 steps, 1e-5): Lamb parameter groups with their own ``lamb_weight_decay`` / ``beta1`` /
``epsilon`` (the whole-parameter trust ratio must use the group's settings, not the last group paddle stepped);
per-parameter ``ParamAttr(regularizer=..., learning_rate=...)`` overriding the optimizer's decay; ``need_clip=False``
under ``ClipGradByNorm``; ``ClipGradByGlobalNorm(auto_skip_clip=True)``; ``paddle.nn.utils.clip_grad_norm_`` by hand
after a ``GradScaler``'s ``unscale_``. In the simulated world, and on real ranks (2 ranks: MLP TP 2, ZeRO-2,
PaddleFormers llama TP 2; 4 ranks: dp2 x tp2 + ZeRO-2; tests/dist_scripts/optim_forms6_worker.py).
docs/optimizer_forms.md lists what was probed."""
import os
import pathlib

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as ap
from dist_scripts import shared_launch
from loops2_helpers import RUNS, XS, YS, One, compare, params
from optim_forms6_worker import FORMS, RUNS2, RUNS4, one_process
from test_probe_optim_forms_ckpt import Net

O, R = paddle.optimizer, paddle.regularizer
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_scripts", "optim_forms6_worker.py")
JOB = shared_launch.job(__name__, "optim_forms6", WORKER, 2, args=lambda out: [out], timeout=200)
JOB4 = shared_launch.job(__name__, "optim_forms6_four", WORKER, 4, args=lambda out: [out, "four"], timeout=200)


def train(env, make_opt, steps=3, hand=None, scaler=False):
    m = env.model()
    m, opt = env.wrap(m, make_opt(m))
    sc = paddle.amp.GradScaler(init_loss_scaling=64.0) if scaler else None
    out = []
    for s in range(steps):
        loss = F.mse_loss(m(env.x(XS[s])), paddle.to_tensor(YS[s]))
        if sc:
            sc.scale(loss).backward()
            sc.unscale_(opt)
        else:
            loss.backward()
        if hand:
            hand(m)
        if sc:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
        opt.clear_grad()
        out += [float(loss), float(opt.get_lr())]
    return out, params(m)


def both(run, make_opt, **kw):
    want = train(One(), make_opt, **kw)
    with ap.simulate(world_size=4):
        got = train(RUNS[run](), make_opt, **kw)
    return compare(want, got, 1e-5)


def lamb_groups(m, **second):
    return O.Lamb(0.05, parameters=[{"params": m.fc1.parameters(), "lamb_weight_decay": 0.3, "beta1": 0.5,
                                     "epsilon": 1e-3}, {"params": m.fc2.parameters(), **second}])


@pytest.mark.parametrize("run", ["dp x tp", "zero2", "zero3", "parallelize tp", "parallelize zero2"])
def test_lamb_groups_take_their_own_decay_and_betas_in_the_whole_trust_ratio(run):
    both(run, lamb_groups)


def test_lamb_groups_differ_from_one_lamb_over_all():
    """Negative control: the groups' settings change the values, so the test above can fail."""
    with pytest.raises(AssertionError):
        compare(train(One(), lamb_groups), train(One(), lambda m: O.Lamb(0.05, parameters=m.parameters())), 1e-5)


def test_lamb_group_exclusion_function_is_the_groups():
    """A group's own ``exclude_from_weight_decay_fn`` (paddle reads it per group) under tensor parallelism."""
    both("dp x tp", lambda m: lamb_groups(m, exclude_from_weight_decay_fn=lambda p: True, lamb_weight_decay=0.5))


def lamb_name_exclusion(m):
    names = {m.fc2.bias.name}
    return O.Lamb(0.05, parameters=[{"params": m.fc1.parameters()},
                                    {"params": m.fc2.parameters(), "lamb_weight_decay": 0.5,
                                     "exclude_from_weight_decay_fn": lambda p: p.name in names}])


@pytest.mark.parametrize("run", ["dp x tp", "zero2", "parallelize dp", "parallelize zero3"])
def test_a_groups_name_based_exclusion_sees_the_users_names(run):
    """A group's own ``exclude_from_weight_decay_fn`` by parameter name was called with a ZeRO chunk's or another
    rank's copy's name (``...zero_r0``, ``...sim_r1``), so the excluded bias was decayed."""
    both(run, lamb_name_exclusion)


LAST_GROUP_OWN = {
    "adam beta1": lambda m: O.Adam(0.05, parameters=[{"params": m.fc1.parameters()},
                                                     {"params": m.fc2.parameters(), "beta1": 0.3, "epsilon": 0.1}]),
    "momentum": lambda m: O.Momentum(0.05, parameters=[{"params": m.fc1.parameters()},
                                                       {"params": m.fc2.parameters(), "momentum": 0.2,
                                                        "use_nesterov": True}]),
    "rmsprop": lambda m: O.RMSProp(0.01, parameters=[{"params": m.fc1.parameters()},
                                                     {"params": m.fc2.parameters(), "rho": 0.5, "centered": True}]),
    "lamb exclusion": lambda m: lamb_groups(m, exclude_from_weight_decay_fn=lambda p: True, lamb_weight_decay=0.5),
}


@pytest.mark.parametrize("run", ["parallelize dp", "dp x tp", "zero2"])
@pytest.mark.parametrize("form", list(LAST_GROUP_OWN))
def test_the_last_groups_own_settings_stay_in_that_group(run, form):
    """paddle's step leaves the last group's settings in the optimizer's attributes (``_beta1``,
    ``_exclude_from_weight_decay_fn`` ...); the other ranks' and ZeRO's optimizers must take the constructor's
    defaults for the groups without their own."""
    both(run, LAST_GROUP_OWN[form])


class AttrMLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8, weight_attr=paddle.ParamAttr(regularizer=R.L1Decay(0.05), learning_rate=0.3),
                             bias_attr=paddle.ParamAttr(learning_rate=3.0))
        self.fc2 = nn.Linear(8, 4, weight_attr=paddle.ParamAttr(need_clip=False))

    def forward(self, x):
        return self.fc2(F.tanh(self.fc1(x)))


class AttrOne(One):
    def model(self):
        paddle.seed(3)
        return AttrMLP()


def _attr_run(run):
    """``RUNS[run]``'s layout over the AttrMLP (the runs build their model through ``One.model``)."""
    env = RUNS[run]()
    env.__class__ = type("Attr" + type(env).__name__, (type(env), AttrOne), {})
    return env


@pytest.mark.parametrize("run", ["dp x tp", "zero1", "zero3", "parallelize zero2"])
@pytest.mark.parametrize("form", ["momentum l2 by norm", "sgd global clip"])
def test_param_attr_regularizer_lr_and_need_clip_over_the_optimizers(run, form):
    make = {"momentum l2 by norm": lambda m: O.Momentum(0.1, parameters=m.parameters(), use_nesterov=True,
                                                        weight_decay=0.1, grad_clip=nn.ClipGradByNorm(0.01)),
            "sgd global clip": lambda m: O.SGD(0.5, parameters=m.parameters(), weight_decay=R.L2Decay(0.1),
                                               grad_clip=nn.ClipGradByGlobalNorm(0.01, auto_skip_clip=True))}[form]
    want = train(AttrOne(), make)
    with ap.simulate(world_size=4):
        got = train(_attr_run(run), make)
    compare(want, got, 1e-5)


@pytest.mark.parametrize("run", ["dp x tp", "parallelize tp"])
def test_hand_clip_after_a_grad_scalers_unscale(run):
    both(run, lambda m: O.Adam(0.05, parameters=m.parameters()), scaler=True,
         hand=lambda m: paddle.nn.utils.clip_grad_norm_(m.parameters(), 0.01))


# ---- real ranks ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two():
    out, ranks = shared_launch.results(JOB)
    return pathlib.Path(out), ranks


@pytest.fixture(scope="module")
def four():
    out, ranks = shared_launch.results(JOB4)
    return pathlib.Path(out), ranks


def _check(launch, run, form):
    out, ranks = launch
    for res in ranks:
        assert res["done"][f"{run}-{form}"] == "ok", f"rank {res['rank']}: {res['done'][f'{run}-{form}']}"
    got = np.load(out / f"{run}-{form}.npz")
    want = one_process(run, form)
    compare(want, (list(got["losses"]), {n: got["p:" + n] for n in want[1]}), 1e-5)


@pytest.mark.parametrize("run", RUNS2)
@pytest.mark.parametrize("form", list(FORMS))
def test_two_real_ranks_equal_one_process(two, run, form):
    _check(two, run, form)


@pytest.mark.parametrize("run", RUNS4)
@pytest.mark.parametrize("form", list(FORMS))
def test_four_real_ranks_equal_one_process(four, run, form):
    _check(four, run, form)


def _reconfigured(dist):
    """Adam groups, the last with its own beta1 / epsilon; rebuilt from plain data parallel (the user's optimizer
    steps) to ZeRO-2 after 2 of 4 steps: the rebuilt optimizer is a clone made after paddle's steps."""
    paddle.seed(3)
    m = Net({"h": 8})
    opt = O.Adam(0.05, parameters=[{"params": m.fc1.parameters()},
                                   {"params": m.fc2.parameters(), "beta1": 0.3, "epsilon": 0.1}])
    if dist:
        s = ap.Strategy()
        s.data_parallel.degree = 4
        m, opt = ap.parallelize(m, opt, strategy=s)
    out = []
    for i in range(4):
        if dist and i == 2:
            s2 = ap.Strategy()
            s2.data_parallel.degree, s2.sharding.enable, s2.sharding.stage = 4, True, 2
            ap.reconfigure_distributed_model(m, s2, optimizer=opt)
        loss = F.mse_loss(m(paddle.to_tensor(XS[i])), paddle.to_tensor(YS[i]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        out += [float(loss), float(opt.get_lr())]
    return out, params(m)


def test_reconfigure_mid_run_keeps_the_constructors_settings_for_groups_without_their_own():
    want = _reconfigured(False)
    with ap.simulate(world_size=4):
        compare(want, _reconfigured(True), 1e-5)


class UnusedMLP(nn.Layer):
    """``fc2`` (row-parallel in the runs' layouts) takes no part in the loss: no gradient, not stepped."""
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(6, 8), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x):
        return self.out(F.tanh(self.fc1(x)))


class UnusedOne(One):
    def model(self):
        paddle.seed(3)
        return UnusedMLP()


@pytest.mark.parametrize("run", ["dp x tp", "zero1", "zero3", "parallelize tp", "parallelize zero2"])
def test_lamb_leaves_an_unused_parameter_alone(run):
    """Lamb over an unused tensor-parallel parameter or under ZeRO crashed (KeyError on the piece's moments:
    paddle does not step a parameter without a gradient, so its optimizer has none)."""
    make = lambda m: O.Lamb(0.05, parameters=m.parameters(), grad_clip=nn.ClipGradByNorm(0.01))   # noqa: E731
    want = train(UnusedOne(), make)
    env = RUNS[run]()
    env.__class__ = type("Unused" + type(env).__name__, (type(env), UnusedOne), {})
    with ap.simulate(world_size=4):
        compare(want, train(env, make), 1e-5)
