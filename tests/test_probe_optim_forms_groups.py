"""Optimizer forms a paddle user writes (parameter groups with their own grad_clip, learning-rate multipliers and
weight decay by name, set_lr_scheduler mid-run, Rprop / ASGD, LBFGS) over a distributed model: losses, learning
rates and every parameter after 3 steps equal one process in the simulated world, or the form is refused by name.
docs/optimizer_forms.md has the table of forms probed."""
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as ap
from loops2_helpers import RUNS, XS, YS, One, compare, params

LR = paddle.optimizer.lr


def train(env, make_opt, steps=3, after=None):
    m = env.model()
    m, opt = env.wrap(m, make_opt(m))
    out = []
    for s in range(steps):
        loss = F.mse_loss(m(env.x(XS[s])), paddle.to_tensor(YS[s]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        if after:
            after(opt, s)
        out += [float(loss), float(opt.get_lr())]
    return out, params(m)


def groups(m, own_clip=True, sched=None):
    """Trainer-style: decay by the user's parameter names, a group with a lr multiplier and its own decay, a
    group with its own clip; the optimizer's global-norm clip is the other group's."""
    decay = {p.name for n, p in m.named_parameters() if "bias" not in n}
    second = {"params": [m.fc2.weight, m.fc2.bias]}
    if own_clip:
        second["grad_clip"] = nn.ClipGradByGlobalNorm(0.01)
    return paddle.optimizer.AdamW(
        sched or 0.05, parameters=[{"params": [m.fc1.weight, m.fc1.bias], "learning_rate": 2.0, "weight_decay": 0.3},
                                   second],
        weight_decay=0.1, apply_decay_param_fun=lambda n: n in decay, grad_clip=nn.ClipGradByGlobalNorm(0.02))


def both(run, probe):
    want = probe(One())
    with ap.simulate(world_size=4):
        got = probe(RUNS[run]())
    return compare(want, got)


@pytest.mark.parametrize("run", ["dp x tp", "zero2", "parallelize dp", "parallelize zero3"])
def test_each_group_is_clipped_by_its_own_norm(run):
    warm = lambda: LR.LinearWarmup(LR.CosineAnnealingDecay(0.1, T_max=4), 2, 0.01, 0.1)   # noqa: E731
    both(run, lambda env: train(env, lambda m: groups(m, sched=warm()), after=lambda o, s: o._learning_rate.step()))


def test_one_clip_over_all_groups_differs_from_paddle():
    """Negative control: paddle clips groups apart; one global-norm clip over every parameter (what the
    distributed step did) gives other values, so the test above can fail."""
    want = train(One(), groups)
    def one_clip(m):
        opt = groups(m, own_clip=False)
        for g in opt._param_groups:
            g["grad_clip"] = None
        return opt
    got = train(One(), lambda m: _clip_all(one_clip(m)))
    with pytest.raises(AssertionError):
        compare(want, got)


def _clip_all(opt):
    """A paddle optimizer clipping every parameter together by one global norm before its step."""
    step, clip = opt.step, nn.ClipGradByGlobalNorm(0.02)

    def clipped_step():
        with paddle.no_grad():
            pairs = clip([(p, p.grad) for p in opt._parameter_list[0]["params"] + opt._parameter_list[1]["params"]])
            for p, g in pairs:
                p.grad.set_value(g)
        step()
    opt.step = clipped_step
    return opt


def switch_scheduler(opt, s):
    if s == 0:
        opt.set_lr_scheduler(LR.StepDecay(0.2, step_size=1, gamma=0.5))
    else:
        opt._learning_rate.step()


@pytest.mark.parametrize("run", ["dp x tp", "zero2", "parallelize zero3"])
def test_set_lr_scheduler_mid_run_reaches_every_rank(run):
    both(run, lambda env: train(env, lambda m: paddle.optimizer.Adam(0.05, parameters=m.parameters()),
                                after=switch_scheduler))


class SplitZero(One):
    """ZeRO-1 over a dim one weight is already sharded on: a part under ZeRO, a part kept in its layout."""
    def model(self):
        self.mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])

        def fn(name, layer, mesh):
            if name == "fc1":
                layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(1)])
        return ap.shard_layer(super().model(), self.mesh, fn)

    def wrap(self, m, opt):
        return m, ap.shard_optimizer(opt, ap.ShardingStage1("dp", self.mesh))

    def x(self, a):
        return ap.shard_tensor(paddle.to_tensor(a), self.mesh, [ap.Replicate()])


@pytest.mark.parametrize("after", [switch_scheduler, lambda o, s: o.set_lr(o.get_lr() * 0.3)])
def test_learning_rate_set_on_a_split_zero_optimizer_reaches_both_parts(after):
    make = lambda m: paddle.optimizer.Adam(0.05, parameters=m.parameters())     # noqa: E731
    want = train(One(), make, after=after)
    with ap.simulate(world_size=4):
        compare(want, train(SplitZero(), make, after=after))


@pytest.mark.parametrize("make", [lambda m: paddle.optimizer.Rprop(0.05, parameters=m.parameters()),
                                  lambda m: paddle.optimizer.ASGD(0.05, batch_num=2, parameters=m.parameters())])
@pytest.mark.parametrize("run", ["dp x tp", "zero2"])
def test_rprop_and_asgd_equal_one_process(make, run):
    both(run, lambda env: train(env, make))


@pytest.mark.parametrize("run", ["dp x tp", "zero1", "parallelize dp"])
def test_lbfgs_is_refused_by_name(run):
    with ap.simulate(world_size=4):
        env = RUNS[run]()
        m = env.model()
        with pytest.raises(NotImplementedError, match="LBFGS.*closure"):
            env.wrap(m, paddle.optimizer.LBFGS(0.5, parameters=m.parameters()))


def test_lr_ratio_sees_the_users_parameter_names():
    """AdamW's lr_ratio(param) (paddle runs it on GPUs only) is asked about a ZeRO chunk or a rank's copy under
    the name of the parameter it stands for."""
    from autoparallel.parallel.optim_clone import _named_ratio

    seen = []
    ratio = _named_ratio(lambda p: seen.append(p.name) or 0.5, {"w.zero_r1": "linear_0.w_0"})
    chunk = paddle.create_parameter([2], "float32")
    chunk.name = "w.zero_r1"
    assert ratio(chunk) == 0.5 and seen == ["linear_0.w_0"]


def _pipeline_groups(model):
    ps = list(model.parameters())
    return paddle.optimizer.AdamW(0.01, parameters=[{"params": ps[:4], "learning_rate": 2.0},
                                                    {"params": ps[4:], "grad_clip": nn.ClipGradByGlobalNorm(0.02)}],
                                  grad_clip=nn.ClipGradByGlobalNorm(0.05))


@pytest.mark.parametrize("dp", [1, 2])
def test_pipeline_clips_each_group_by_its_norm_over_every_stage(dp):
    import pp_common
    from test_pipeline_compose import mismatched, strategy

    from autoparallel.parallel.pipeline.runtime import apply_pp

    model = pp_common.build("gpt", False)
    opt, want_losses = _pipeline_groups(model), []
    for x, y in pp_common.batches(3):
        loss = F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        want_losses.append(float(loss))
    want = {n: p.numpy() for n, p in model.named_parameters()}
    with ap.simulate(world_size=2 * dp):
        model = pp_common.build("gpt", False)
        pipe = apply_pp(model, strategy({"schedule": "1F1B", "dp": dp}))
        opt, losses = pipe.wrap_optimizer(_pipeline_groups(model)), []
        for x, y in pp_common.batches(3):
            losses.append(pipe.train_batch(x, y))
            opt.step()
            opt.clear_grad()
        assert mismatched(pipe, want) == []
    compare((want_losses, {}), (losses, {}))


def test_pipeline_zero_refuses_group_clips():
    import pp_common

    from autoparallel.parallel.pipeline.runtime import apply_pp

    with ap.simulate(world_size=4):
        model = pp_common.build("gpt", False)
        s = pp_common.strategy({"schedule": "1F1B", "dp": 2})
        s.sharding.enable, s.sharding.stage = True, 1
        pipe = apply_pp(model, s)
        with pytest.raises(NotImplementedError, match="parameter groups.*own norm"):
            pipe.wrap_optimizer(_pipeline_groups(model))


def test_split_zero_refuses_a_group_clip():
    """A group's own clip on the split ZeRO optimizer was dropped (its parts carry no clips): refused, as the
    optimizer's clip is."""
    def make(m):
        return paddle.optimizer.AdamW(0.05, parameters=[{"params": [m.fc1.weight, m.fc1.bias]},
                                                        {"params": [m.fc2.weight, m.fc2.bias],
                                                         "grad_clip": nn.ClipGradByGlobalNorm(0.01)}])
    with ap.simulate(world_size=4), pytest.raises(NotImplementedError, match="gradient clipping with ZeRO"):
        env = SplitZero()
        m = env.model()
        env.wrap(m, make(m))


def test_clips_are_back_on_the_users_optimizer_after_a_step():
    """The wrappers switch paddle's norm clips off for their step only: the user's optimizer keeps its own and its
    groups' clip objects (a later one-process use, state_dict, a rebuild read them)."""
    with ap.simulate(world_size=4):
        env = RUNS["dp x tp"]()
        m = env.model()
        inner = groups(m)
        clips = [inner._grad_clip] + [g["grad_clip"] for g in inner._param_groups]
        m, opt = env.wrap(m, inner)
        F.mse_loss(m(env.x(XS[0])), paddle.to_tensor(YS[0])).backward()
        opt.step()
    assert [inner._grad_clip] + [g["grad_clip"] for g in inner._param_groups] == clips
    assert all(c is not None for c in clips)
