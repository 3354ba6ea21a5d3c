"""The LR schedule across a checkpoint: ``ap.save_state_dict(ap.training_state(model, opt))`` then a fresh model
and optimizer loaded with ``ap.load_state_dict`` (or ``CheckpointManager.restore``) continue the schedule where it
was (it restarted silently; LinearWarmup's wrapped scheduler made the manager's resume crash), in one process and
under DP x TP / ZeRO in the simulated world, against one uninterrupted process."""
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as ap
from loops2_helpers import RUNS, XS, YS, One, compare, params

LR = paddle.optimizer.lr
SCHEDULES = {
    "warmup cosine": lambda: LR.LinearWarmup(LR.CosineAnnealingDecay(0.1, T_max=4), 2, 0.0, 0.1),
    "one cycle": lambda: LR.OneCycleLR(0.1, total_steps=8),
    "warm restarts": lambda: LR.CosineAnnealingWarmRestarts(0.1, T_0=1, T_mult=2),     # T_cur / T_i: not in its state
    "plateau": lambda: LR.ReduceOnPlateau(0.1, patience=0, factor=0.5, threshold=10.0),
}


def build(env, sched):
    m = env.model()
    s = SCHEDULES[sched]()
    m, opt = env.wrap(m, paddle.optimizer.AdamW(s, parameters=m.parameters(), grad_clip=nn.ClipGradByGlobalNorm(0.05)))
    return m, opt, s


def one(env, m, opt, s, i, out):
    loss = F.mse_loss(m(env.x(XS[i])), paddle.to_tensor(YS[i]))
    loss.backward()
    opt.step()
    opt.clear_grad()
    s.step(loss) if isinstance(s, LR.ReduceOnPlateau) else s.step()
    out += [float(loss), float(opt.get_lr())]


def straight(env, sched):
    m, opt, s = build(env, sched)
    out = []
    for i in range(4):
        one(env, m, opt, s, i, out)
    return out, params(m)


def resumed(env, sched, path, manager=False, load=True):
    """2 steps, save; a fresh model and optimizer load and run 2 more."""
    m, opt, s = build(env, sched)
    out = []
    for i in range(2):
        one(env, m, opt, s, i, out)
    if manager:
        ap.CheckpointManager(path, optimizer=opt).save(ap.training_state(m, opt), step=2)
    else:
        ap.save_state_dict(ap.training_state(m, opt), path)
    m, opt, s = build(env, sched)
    if load and manager:
        ap.CheckpointManager(path, optimizer=opt).restore(ap.training_state(m, opt))
    elif load == "plain":
        ap.load_state_dict(dict(ap.training_state(m, opt)), path)
    elif load:
        ap.load_state_dict(ap.training_state(m, opt), path)
    for i in range(2, 4):
        one(env, m, opt, s, i, out)
    return out, params(m)


@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_training_state_continues_the_schedule_in_one_process(sched, tmp_path):
    compare(straight(One(), sched), resumed(One(), sched, str(tmp_path / "c")))


def test_manager_resume_of_a_wrapped_scheduler(tmp_path):
    compare(straight(One(), "warmup cosine"), resumed(One(), "warmup cosine", str(tmp_path), manager=True))


@pytest.mark.parametrize("run", ["dp x tp", "zero2", "parallelize zero3"])
def test_training_state_continues_the_schedule_distributed(run, tmp_path):
    want = straight(One(), "warmup cosine")
    with ap.simulate(world_size=4):
        compare(want, resumed(RUNS[run](), "warmup cosine", str(tmp_path / "c")))


def test_tensors_without_the_schedule_differ(tmp_path):
    """Negative control: the same checkpoint loaded as a plain dict (tensors only, the scheduler left fresh) does
    not continue the run."""
    with pytest.raises(AssertionError):
        compare(straight(One(), "warmup cosine"), resumed(One(), "warmup cosine", str(tmp_path / "c"), load="plain"))


def test_a_checkpoint_without_a_schedule_warns(tmp_path):
    m, opt, s = build(One(), "one cycle")
    path = str(tmp_path / "c")
    ap.save_state_dict({"model": dict(m.named_parameters())}, path)       # a plain dict: no schedule saved
    state = ap.training_state(m, opt)
    del state["optimizer"]
    with pytest.warns(UserWarning, match="holds no LR schedule"):
        info = ap.load_state_dict(state, path)
    assert "lr_scheduler" not in info.restored


class Net(nn.Layer):
    """A model rebuildable as type(model)(model.config), as reconfigure needs."""
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(F.tanh(self.fc1(x)))


def _reconfigured(dist, stage=2):
    """Parameter groups (lr multiplier, decay by the user's names, a group clip) and a schedule, 4 steps; the
    distributed run is rebuilt under another ZeRO stage by reconfigure_distributed_model after 2."""
    paddle.seed(3)
    m = Net({"h": 8})
    sched = LR.StepDecay(0.05, 1, 0.7)
    decay = {p.name for n, p in m.named_parameters() if "bias" not in n}
    opt = paddle.optimizer.AdamW(sched, parameters=[
        {"params": [m.fc1.weight, m.fc1.bias], "learning_rate": 3.0},
        {"params": [m.fc2.weight, m.fc2.bias], "grad_clip": nn.ClipGradByGlobalNorm(0.01)}],
        weight_decay=0.5, apply_decay_param_fun=lambda n: n in decay)
    if dist:
        s = ap.Strategy()
        s.data_parallel.degree, s.sharding.enable, s.sharding.stage = 4, True, 1
        m, opt = ap.parallelize(m, opt, strategy=s)
    out = []
    for i in range(4):
        if dist and i == 2:
            s2 = ap.Strategy()
            s2.data_parallel.degree, s2.sharding.enable, s2.sharding.stage = 4, True, stage
            ap.reconfigure_distributed_model(m, s2, optimizer=opt)
        loss = F.mse_loss(m(paddle.to_tensor(XS[i])), paddle.to_tensor(YS[i]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        sched.step()
        out += [float(loss), float(opt.get_lr())]
    return out, params(m)


def test_reconfigure_keeps_groups_decay_names_and_group_clips():
    """The rebuilt optimizer put every parameter in the first group under fresh names (lr multiplier, group clip
    and the name-based decay lost)."""
    want = _reconfigured(False)
    with ap.simulate(world_size=4):
        compare(want, _reconfigured(True))
