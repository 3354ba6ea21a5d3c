"""Checkpoints as a user's loop writes them, across strategies, against an uninterrupted one-process run.

* ``strategy.checkpoint`` saves from the optimizer's post-step hook, before the loop's own ``sched.step()``: the
  saved LR schedule was one scheduler step behind, so a resumed run (same or another strategy) trained on with the
  previous step's learning rate. The checkpoint now follows the scheduler until the next optimizer step.
* ``CheckpointManager(dir).save(ap.training_state(model, opt), step)`` without ``optimizer=`` dropped the LR
  schedule (``ap.save_state_dict`` of the same state keeps it).
* save under one strategy, resume under another (dp2 -> tp2, tp2 -> ZeRO-3, a 2 x 2 mesh -> 4 data ranks, ZeRO-3
  -> one process and back), AdamW with weight decay and a StepDecay schedule: equal to one process.
* a save failing in the middle of its write keeps every earlier checkpoint, ``latest`` and the retention;
  bad inputs are typed errors naming the entry, nothing loaded.
"""
import contextlib
import json
import os
import warnings

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel import auto_checkpoint
from autoparallel.checkpoint import (CheckpointManager, CheckpointMismatchError, load_state_dict, schedule_follow,
                                     training_state, verify_checkpoint)
from autoparallel.checkpoint import save as ckpt_save
from autoparallel.checkpoint import writer as ckpt_writer
from autoparallel.parallelize import parallelize
from examples.models import PRESETS, build

RNG = np.random.default_rng(0)
BATCHES = [(RNG.integers(0, 64, (8, 16)), RNG.integers(0, 64, (8, 16))) for _ in range(6)]
ONE = (1, 1, 0)


def gpt(seed=0):
    paddle.seed(seed)
    with paddle.utils.unique_name.guard():
        return build(PRESETS["gpt-tiny"])


def make(cfg, seed=0, root=None):
    """(model, optimizer, scheduler) for cfg = (dp, tp, ZeRO stage); ONE is a plain paddle run; ``root``
    switches strategy.checkpoint on (every step, keep the last 2)."""
    m = gpt(seed)
    sched = paddle.optimizer.lr.StepDecay(0.01, step_size=1, gamma=0.7)
    opt = paddle.optimizer.AdamW(sched, parameters=m.parameters(), weight_decay=0.1)
    if cfg == ONE and root is None:
        return m, opt, sched
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = cfg[0], cfg[1]
    if cfg[2]:
        s.sharding.enable, s.sharding.stage = True, cfg[2]
    if root is not None:
        s.checkpoint.enable, s.checkpoint.dir = True, str(root)
        s.checkpoint.save_interval_steps, s.checkpoint.keep_last = 1, 2
    m, opt = parallelize(m, opt, strategy=s)
    return m, opt, sched


def world(cfg):
    return contextlib.nullcontext() if cfg == ONE else ap.simulate(world_size=cfg[0] * cfg[1])


def step(m, opt, sched, i):
    x, y = BATCHES[i]
    loss = F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y))
    loss.backward()
    opt.step()
    opt.clear_grad()
    sched.step()
    return float(loss)


@pytest.fixture(scope="module")
def reference():
    m, opt, sched = make(ONE)
    return [step(m, opt, sched, i) for i in range(6)]


@pytest.fixture(autouse=True)
def _fresh_run():
    auto_checkpoint.reset()
    yield
    auto_checkpoint.reset()


def quiet():
    """Generators saved under another world size stay as seeded (a warning, expected here)."""
    w = warnings.catch_warnings()
    w.__enter__()
    warnings.simplefilter("ignore", RuntimeWarning)
    return w


# ---- strategy.checkpoint: the schedule of the step, not of the middle of the step -----------------------------
def hook_resume(tmp_path, src, dst):
    """4 steps under ``src`` saving every step, then a fresh ``dst`` run resumes and trains steps 4 and 5."""
    with world(src):
        m, opt, sched = make(src, root=tmp_path)
        first = [step(m, opt, sched, i) for i in range(4)]
    auto_checkpoint.reset()
    with world(dst):
        m, opt, sched = make(dst, seed=3, root=tmp_path)
        w = quiet()
        info = ap.resume_from_last_checkpoint()
        w.__exit__(None, None, None)
        assert info.step == 4 and "lr_scheduler" in info.restored
        resumed_at = sched.last_epoch
        return first + [step(m, opt, sched, i) for i in range(4, 6)], resumed_at


@pytest.mark.parametrize("src,dst", [((2, 1, 0), (2, 1, 0)), ((2, 1, 0), (2, 2, 3))])
def test_strategy_checkpoint_resumes_with_the_schedule_of_the_saved_step(tmp_path, reference, src, dst):
    got, resumed_at = hook_resume(tmp_path, src, dst)
    assert resumed_at == 4                                              # the schedule after 4 steps
    np.testing.assert_allclose(got, reference, rtol=1e-5)
    assert sorted(os.listdir(tmp_path)) == [".autoparallel-run", "latest", "step-00000005", "step-00000006"]
    meta = json.load(open(tmp_path / "step-00000006" / "metadata.json"))
    assert meta["runtime"]["lr_scheduler"]["last_epoch"] == 6           # as after the loop's own sched.step()
    assert verify_checkpoint(str(tmp_path / "step-00000006")) == str(tmp_path / "step-00000006")


def test_negative_control_the_schedule_of_the_middle_of_the_step_changes_the_run(tmp_path, reference, monkeypatch):
    monkeypatch.setattr(schedule_follow, "follow", lambda optimizer, path: None)
    got, resumed_at = hook_resume(tmp_path, (2, 1, 0), (2, 1, 0))
    assert resumed_at == 3                                              # what the hook alone saw
    np.testing.assert_allclose(got[:5], reference[:5], rtol=1e-5)
    assert not np.isclose(got[5], reference[5], rtol=1e-5)


def test_a_failed_schedule_update_warns_and_the_checkpoint_still_loads(tmp_path, monkeypatch):
    from autoparallel.checkpoint import atomic

    def full(path, data, before_rename=None):
        raise OSError(28, "No space left on device", path)

    with world((2, 1, 0)):
        m, opt, sched = make((2, 1, 0), root=tmp_path)
        step(m, opt, sched, 0)
        x, y = BATCHES[1]
        F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y)).backward()
        opt.step()                                                      # saves step 2 from the hook
        opt.clear_grad()
        monkeypatch.setattr(atomic, "write_file_atomic", full)
        with pytest.warns(RuntimeWarning, match=r"step-00000002 keeps the LR schedule .*No space left"):
            sched.step()
        sched.step()                                                    # the window is closed: no second warning
    meta = json.load(open(tmp_path / "step-00000002" / "metadata.json"))
    assert meta["runtime"]["lr_scheduler"]["last_epoch"] == 1
    assert verify_checkpoint(str(tmp_path / "step-00000002")) == str(tmp_path / "step-00000002")


def amp_run(tmp_path):
    """One process, AMP loss scaling, a post-step hook saving every step; ``it(x)`` is one iteration."""
    from autoparallel.parallel.amp import AmpOptimizer, LossScaler

    paddle.seed(0)
    m = paddle.nn.Linear(4, 3)
    sched = paddle.optimizer.lr.StepDecay(0.1, step_size=1, gamma=0.5)
    opt = AmpOptimizer(paddle.optimizer.AdamW(sched, parameters=m.parameters()), LossScaler(8.0))
    mgr = CheckpointManager(str(tmp_path), optimizer=opt)
    opt.register_step_post_hook(lambda o: mgr.save(training_state(m, opt), 1))

    def it(value):
        opt.scale((m(paddle.full([2, 4], value)) ** 2).mean()).backward()
        ran = opt.step()
        opt.clear_grad()
        sched.step()
        return ran

    return it


def saved_epoch(tmp_path, step=1):
    return json.load(open(tmp_path / f"step-{step:08d}" / "metadata.json"))["runtime"]["lr_scheduler"]["last_epoch"]


def test_a_step_the_loss_scaler_skips_ends_the_schedule_window(tmp_path, monkeypatch):
    it = amp_run(tmp_path / "a")
    assert it(1.0) and saved_epoch(tmp_path / "a") == 1                  # the hook's save, then sched.step()
    assert not it(float("inf")) and saved_epoch(tmp_path / "a") == 1     # skipped: no hooks, the window closed
    monkeypatch.setattr(schedule_follow, "_amp_marks", lambda optimizer: ())
    it = amp_run(tmp_path / "b")                                          # negative control: not seen as a step
    assert it(1.0) and not it(float("inf")) and saved_epoch(tmp_path / "b") == 2


def test_a_manager_without_optimizer_keeps_the_training_states_schedule(tmp_path):
    def one():
        paddle.seed(0)
        m = paddle.nn.Linear(4, 3)
        sched = paddle.optimizer.lr.StepDecay(0.1, step_size=1, gamma=0.5)
        return m, paddle.optimizer.AdamW(sched, parameters=m.parameters()), sched

    m, opt, sched = one()
    for _ in range(3):
        (m(paddle.ones([2, 4])) ** 2).mean().backward()
        opt.step()
        opt.clear_grad()
        sched.step()
    CheckpointManager(str(tmp_path)).save(training_state(m, opt), 3)
    m2, opt2, sched2 = one()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                  # nothing reported left out
        info = CheckpointManager(str(tmp_path)).restore(training_state(m2, opt2))
    assert "lr_scheduler" in info.restored
    assert (sched2.last_epoch, sched2.get_lr()) == (3, sched.get_lr()) == (3, 0.0125)


# ---- one strategy's checkpoint, another strategy's run --------------------------------------------------------
@pytest.mark.parametrize("src,dst", [((2, 1, 0), (1, 2, 0)), ((1, 2, 0), (4, 1, 3)), ((2, 2, 0), (4, 1, 0)),
                                     ((2, 2, 3), ONE), (ONE, (2, 2, 3))])
def test_a_checkpoint_resumes_under_another_strategy_as_one_process(tmp_path, reference, src, dst):
    with world(src):
        m, opt, sched = make(src)
        first = [step(m, opt, sched, i) for i in range(2)]
        CheckpointManager(str(tmp_path), optimizer=opt).save(training_state(m, opt), 2)
    with world(dst):
        m, opt, sched = make(dst, seed=5)
        w = quiet()
        info = CheckpointManager(str(tmp_path), optimizer=opt).restore(training_state(m, opt))
        w.__exit__(None, None, None)
        assert "lr_scheduler" in info.restored
        rest = [step(m, opt, sched, i) for i in range(2, 4)]
    np.testing.assert_allclose(first + rest, reference[:4], rtol=1e-5)


def test_negative_control_the_model_alone_does_not_resume(tmp_path, reference):
    with world((2, 1, 0)):
        m, opt, sched = make((2, 1, 0))
        [step(m, opt, sched, i) for i in range(2)]
        ap.save_state_dict({"model": training_state(m, opt)["model"]}, str(tmp_path / "ck"))
    with world((1, 2, 0)):
        m, opt, sched = make((1, 2, 0), seed=5)
        load_state_dict({"model": training_state(m, opt)["model"]}, str(tmp_path / "ck"))
        rest = [step(m, opt, sched, i) for i in range(2, 4)]
    assert rest[0] == pytest.approx(reference[2], rel=1e-5)              # the parameters came back
    assert not np.allclose(rest[1], reference[3], rtol=1e-5)             # moments and schedule did not


def mlp(kind, seed=0):
    """An MLP laid out on a 2 x 2 mesh (column / row split on "mp"), on a 1-D mesh of 4 (last layer split) with
    plain or ZeRO states (``shard_optimizer(opt, ShardingStage1)``: a SplitOptimizer), or in one process."""
    paddle.seed(seed)
    m = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 4))
    sched = paddle.optimizer.lr.StepDecay(0.05, 1, 0.5)
    if kind == "one":
        return m, paddle.optimizer.AdamW(sched, parameters=m.parameters(), weight_decay=0.05), sched
    two = kind == "2x2"
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]) if two else ap.ProcessMesh([0, 1, 2, 3], ["x"])
    layouts = {"0": [ap.Replicate(), ap.Shard(1)], "2": [ap.Replicate(), ap.Shard(0)]} if two else {"2": [ap.Shard(1)]}

    def fn(name, layer, pm):
        if name in layouts:
            layer.weight = ap.shard_tensor(layer.weight, pm, layouts[name])
        return layer

    m = ap.shard_layer(m, mesh, fn)
    opt = paddle.optimizer.AdamW(sched, parameters=m.parameters(), weight_decay=0.05)
    opt = ap.shard_optimizer(opt, ap.ShardingStage1("x", mesh)) if kind == "1d-zero" else ap.shard_optimizer(opt)
    return m, opt, sched


def mlp_step(m, opt, sched, i):
    loss = (m(paddle.to_tensor(np.random.default_rng(i).standard_normal((4, 8)).astype("float32"))) ** 2).mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
    if sched is not None:
        sched.step()
    return float(loss)


@pytest.mark.parametrize("src,dst", [("2x2", "1d"), ("2x2", "1d-zero"), ("1d-zero", "2x2"), ("one", "1d-zero")])
def test_a_2x2_mesh_checkpoint_resumes_on_a_1d_mesh_split_optimizer_included(tmp_path, src, dst):
    m, opt, sched = mlp("one")
    want = [mlp_step(m, opt, sched, i) for i in range(4)]
    sim = {k: (contextlib.nullcontext() if k == "one" else ap.simulate(world_size=4)) for k in (src, dst)}
    with sim[src]:
        m, opt, sched = mlp(src)
        got = [mlp_step(m, opt, sched, i) for i in range(2)]
        CheckpointManager(str(tmp_path), optimizer=opt).save(training_state(m, opt), 2)
    with sim[dst]:
        m, opt, sched = mlp(dst, seed=4)
        w = quiet()
        info = CheckpointManager(str(tmp_path), optimizer=opt).restore(training_state(m, opt))
        w.__exit__(None, None, None)
        assert "lr_scheduler" in info.restored                           # a SplitOptimizer's schedule was dropped
        got += [mlp_step(m, opt, sched, i) for i in range(2, 4)]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def zero_mlp(stage, seed=0):
    paddle.seed(seed)
    m = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 4))
    opt = paddle.optimizer.AdamW(0.05, parameters=m.parameters())
    if stage is None:
        return m, opt
    s = ap.Strategy()
    s.data_parallel.degree, s.sharding.enable, s.sharding.stage = 4, True, stage
    return parallelize(m, opt, strategy=s)


@pytest.mark.parametrize("stage", [1, 3])
def test_paddle_load_of_model_state_dict_reaches_zero_masters_and_released_parameters(tmp_path, stage):
    """``paddle.distributed.load_state_dict(model.state_dict(), path)`` under ZeRO: the values went into the
    parameters but not into the fp32 master chunks (the next step wrote the stale masters back: ZeRO-1/2), or into
    storage a released ZeRO-3 parameter did not hold (lost at once)."""
    m, opt = zero_mlp(None, seed=1)
    ap.save_state_dict(m.state_dict(), str(tmp_path / "ck"))
    want = [mlp_step(m, opt, None, i) for i in range(3)]
    with ap.simulate(world_size=4):
        m, opt = zero_mlp(stage)
        sd = m.state_dict()
        paddle.distributed.load_state_dict(sd, str(tmp_path / "ck"))
        got = [mlp_step(m, opt, None, i) for i in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-5)


# ---- a save failing in the middle of its write ---------------------------------------------------------------
def test_a_save_failing_mid_write_keeps_the_earlier_checkpoints_latest_and_retention(tmp_path, monkeypatch):
    paddle.seed(0)
    m = paddle.nn.Linear(4, 3)
    opt = paddle.optimizer.AdamW(0.1, parameters=m.parameters())
    mgr = CheckpointManager(str(tmp_path), keep_last=2, optimizer=opt)

    def train():
        (m(paddle.ones([2, 4])) ** 2).mean().backward()
        opt.step()
        opt.clear_grad()

    saved = {}
    for s in (1, 2):
        train()
        mgr.save(training_state(m, opt), s)
        saved[s] = m.weight.numpy().copy()
    real = ckpt_writer.write_rank_file

    def broken(directory, rank, items, block_bytes=ckpt_writer.BLOCK_BYTES):
        real(directory, rank, items[:1], block_bytes)
        raise RuntimeError("writer interrupted")

    monkeypatch.setattr(ckpt_save, "write_rank_file", broken)
    train()
    for s in (3, 2):                                     # a new step, then the newest step again (an overwrite)
        with pytest.raises(RuntimeError, match="writer interrupted"):
            mgr.save(training_state(m, opt), s)
        assert sorted(os.listdir(tmp_path)) == [".autoparallel-run", "latest", "step-00000001", "step-00000002"]
        assert open(tmp_path / "latest").read().strip() == "step-00000002"
    monkeypatch.undo()
    info = CheckpointManager(str(tmp_path), optimizer=opt).restore(training_state(m, opt))
    assert info.step == 2
    np.testing.assert_array_equal(m.weight.numpy(), saved[2])


# ---- bad input: typed, named, nothing loaded -----------------------------------------------------------------
def test_a_float32_checkpoint_into_a_bfloat16_model_names_each_entry_and_loads_nothing(tmp_path):
    paddle.seed(0)
    m = paddle.nn.Linear(4, 3)
    ap.save_state_dict({"model": dict(m.named_parameters())}, str(tmp_path / "ck"))
    low = paddle.nn.Linear(4, 3)
    low.to(dtype="bfloat16")
    before = low.weight.astype("float32").numpy()
    for load in (lambda s: ap.load_state_dict(s, str(tmp_path / "ck")),
                 lambda s: paddle.distributed.load_state_dict(s, str(tmp_path / "ck"))):
        with pytest.raises(CheckpointMismatchError, match=r"'model/weight': dtype bfloat16 in the state, float32"):
            load({"model": dict(low.named_parameters())})
        np.testing.assert_array_equal(low.weight.astype("float32").numpy(), before)


def test_numpy_steps_and_numpy_scalars_in_extra_are_saved_as_python_values(tmp_path):
    state = {"w": paddle.ones([2])}
    extra = {"loss": np.float32(0.5), "seen": [np.int64(3), (np.bool_(True), "x")]}
    ap.save_state_dict(state, str(tmp_path / "ck"), step=np.int64(7), extra=extra)
    info = ap.load_state_dict(state, str(tmp_path / "ck"))
    assert (info.step, info.extra) == (7, {"loss": 0.5, "seen": [3, [True, "x"]]}) and type(info.step) is int
    assert CheckpointManager(str(tmp_path / "r")).maybe_save(state, np.int64(100)).endswith("step-00000100")
    with pytest.raises(TypeError, match=r"its item \['seen'\]\[1\]: a paddle.Tensor"):
        ap.save_state_dict(state, str(tmp_path / "bad"), extra={"seen": [1, paddle.to_tensor(2.0)]})
    with pytest.raises(ValueError, match=r"step must be a non-negative int, got 1.5 \(float\)"):
        CheckpointManager(str(tmp_path / "r")).save(state, 1.5)
    assert not os.path.exists(tmp_path / "bad")


def test_paddle_checkpoint_options_are_refused_by_name(tmp_path):
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        state = {"w": ap.shard_tensor(paddle.ones([4, 2]), mesh, [ap.Shard(0)])}
        path = str(tmp_path / "ck")
        with pytest.raises(NotImplementedError, match=r"save_state_dict\(unique_id=3\)"):
            paddle.distributed.save_state_dict(state, path, None, 0, 3)
        assert not os.path.exists(path)
        paddle.distributed.save_state_dict(state, path)
        for kw in ({"offload": True}, {"unique_id": 1}, {"safetensors": True}):
            with pytest.raises(NotImplementedError, match=f"load_state_dict\\({next(iter(kw))}="):
                paddle.distributed.load_state_dict(state, path, **kw)
        with pytest.raises(TypeError, match="unexpected keyword argument 'strict'"):
            paddle.distributed.load_state_dict(state, path, strict=True)
