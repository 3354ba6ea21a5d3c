"""Run state beyond tensors in CheckpointManager: generators, AMP loss scale, LR schedule (one process;
the 4-rank resume tests cover the gathered generator states)."""
import random

import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.checkpoint.manager import CheckpointManager
from autoparallel.checkpoint.state import training_state
from autoparallel.parallel.amp import AmpOptimizer, LossScaler


def setup():
    paddle.seed(0)
    model = paddle.nn.Linear(4, 3)
    sched = paddle.optimizer.lr.StepDecay(0.1, step_size=2, gamma=0.5)
    opt = AmpOptimizer(paddle.optimizer.AdamW(sched, parameters=model.parameters()), LossScaler(1024.0))
    return model, opt, sched


def draws():
    return paddle.randn([3]).numpy(), np.random.rand(2), random.random()


def test_generators_loss_scale_and_schedule_come_back(tmp_path):
    model, opt, sched = setup()
    mgr = CheckpointManager(str(tmp_path), 1, optimizer=opt)
    state = training_state(model, opt)
    for _ in range(3):
        sched.step()
    opt.scaler.scale_value, opt.scaler.good_steps, opt.scaler.bad_steps = 256.0, 7, 1
    mgr.save(state, 3)
    expected = draws()
    lr = sched.get_lr()
    for _ in range(5):                                   # move everything on
        sched.step()
    opt.scaler.update(True)
    opt.scaler.scale_value = 2.0
    draws()
    info = mgr.restore(state)
    assert sorted(info.restored) == ["amp", "lr_scheduler", "rng"]
    got = draws()
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    assert sched.get_lr() == lr == 0.05 and sched.last_epoch == 3
    assert (opt.scaler.scale_value, opt.scaler.good_steps, opt.scaler.bad_steps) == (256.0, 7, 1)


def test_generators_are_kept_under_another_world_size(tmp_path):
    model, opt, _ = setup()
    with ap.simulate(world_size=2):
        CheckpointManager(str(tmp_path), 1, optimizer=opt).save(training_state(model, opt), 1)
    paddle.seed(5)
    before = paddle.get_rng_state()
    info = CheckpointManager(str(tmp_path), 1, optimizer=opt).restore(training_state(model, opt))
    assert "rng" not in info.restored and "amp" in info.restored
    paddle.set_rng_state(before)
    a = paddle.randn([3]).numpy()
    paddle.seed(5)
    np.testing.assert_array_equal(a, paddle.randn([3]).numpy())     # untouched by the restore


def test_without_optimizer_only_generators(tmp_path):
    model, _, _ = setup()
    mgr = CheckpointManager(str(tmp_path), 1)
    mgr.save({"model": dict(model.named_parameters())}, 1)
    info = mgr.restore({"model": dict(model.named_parameters())})
    assert info.restored == ["rng"]
    with pytest.raises(ValueError, match="save_interval_steps"):
        CheckpointManager(str(tmp_path), 0)
