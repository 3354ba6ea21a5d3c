"""strategy.checkpoint saves from the plain training loop (post-step hook), resume_from_last_checkpoint()
on the current run, fallback_to_cpu_offload mid-run, reconfigure_distributed_model — in the simulated world,
against uninterrupted runs."""
import os

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel import auto_checkpoint
from autoparallel.parallel.sharding import ZeroOptimizer
from autoparallel.testing.models import batch, build


def make(world_stage=1, ckpt_dir=None, interval=2, offload=False):
    s = ap.Strategy()
    if world_stage:
        s.sharding.enable, s.sharding.stage, s.sharding.offload = True, world_stage, offload
    if ckpt_dir is not None:
        s.checkpoint.enable, s.checkpoint.save_interval_steps, s.checkpoint.dir = True, interval, str(ckpt_dir)
    m = build("gpt")
    opt = paddle.optimizer.AdamW(1e-2, parameters=m.parameters(), epsilon=1e-4)
    return ap.parallelize(m, opt, strategy=s)


def train(m, opt, steps):
    for i in steps:
        ids, lab = batch(i)
        F.cross_entropy(m(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean().backward()
        opt.step()
        opt.clear_grad()


def values(m, opt=None) -> dict:
    """Every value of the training state as full arrays by name (a save + merged load: the same names and
    values under every layout, ZeRO chunks included)."""
    import tempfile

    from autoparallel.checkpoint.state import training_state

    path = os.path.join(tempfile.mkdtemp(prefix="ap_values_"), "state")
    ap.save_state_dict(training_state(m, opt) if opt is not None else {"model": dict(m.named_parameters())}, path)
    return {k: np.asarray(v) for k, v in ap.load_merged_state_dict(path, flat=True).items()}


def assert_same(a, b, exact=False):
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_checkpoint_strategy_saves_from_the_plain_loop(tmp_path):
    with ap.simulate(world_size=2):
        m, opt = make(ckpt_dir=tmp_path, interval=2)
        train(m, opt, range(5))
        assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["latest", "step-00000002", "step-00000004"]
        assert auto_checkpoint.current_run().step == 5
        m2, opt2 = make()
        ap.load_state_dict(__import__("autoparallel.checkpoint.state", fromlist=["x"]).training_state(m2, opt2),
                           str(tmp_path / "step-00000004"))
        m3, opt3 = make()
        train(m3, opt3, range(4))
        assert_same(values(m2, opt2), values(m3, opt3), exact=True)      # step 4's state, bit for bit


def test_checkpoint_disabled_saves_nothing(tmp_path):
    with ap.simulate(world_size=2):
        m, opt = make()
        train(m, opt, range(3))
    assert os.listdir(tmp_path) == []


def test_resume_from_last_checkpoint_continues_like_an_uninterrupted_run(tmp_path):
    with ap.simulate(world_size=2):
        m, opt = make(ckpt_dir=tmp_path, interval=2)
        train(m, opt, range(3))                     # saved at step 2; step 3 is lost by the "crash"
        info = ap.resume_from_last_checkpoint()
        assert info.step == 2 and auto_checkpoint.current_run().step == 2
        train(m, opt, range(2, 4))
        after = values(m, opt)
        ref_m, ref_opt = make()
        train(ref_m, ref_opt, range(4))
        assert_same(after, values(ref_m, ref_opt), exact=True)
        assert sorted(n for n in os.listdir(tmp_path) if not n.startswith("."))[-1] == "step-00000004"    # the hook kept counting from the resume


def test_resume_without_a_run_or_checkpoint(tmp_path):
    with pytest.raises(RuntimeError, match="no model was set up"):
        ap.resume_from_last_checkpoint()
    with ap.simulate(world_size=2):
        m, opt = make(ckpt_dir=tmp_path / "none")
        assert ap.resume_from_last_checkpoint() is None


def test_fallback_to_cpu_offload_keeps_every_value_and_trains_identically():
    with ap.simulate(world_size=2):
        m, opt = make(world_stage=2)
        train(m, opt, range(2))
        before = values(m, opt)
        assert ap.fallback_to_cpu_offload(m) is opt and opt.offload
        assert_same(values(m, opt), before, exact=True)
        assert all(p.is_cpu_place() for p in opt.state_places())
        train(m, opt, range(2, 4))
        ref_m, ref_opt = make(world_stage=2, offload=True)      # offload from the start: the same math
        train(ref_m, ref_opt, range(4))
        assert_same(values(m, opt), values(ref_m, ref_opt), exact=True)
        assert ap.fallback_to_cpu_offload(m, opt) is opt          # already offloaded: unchanged


def test_fallback_without_sharding_rebuilds_with_zero1_offload_in_place():
    with ap.simulate(world_size=1):          # one rank: plain (unsharded) optimizer states are checkpointable
        m, opt = make(world_stage=0)
        train(m, opt, range(2))
        before = values(m, opt)
        held = opt
        assert ap.fallback_to_cpu_offload(m) is held
        assert isinstance(opt, ZeroOptimizer) and opt.stage == 1 and opt.offload
        assert auto_checkpoint.current_run().strategy.sharding.offload
        assert_same(values(m, opt), before, exact=True)
        train(m, opt, range(2, 4))
        ref_m, ref_opt = make(world_stage=0)
        train(ref_m, ref_opt, range(4))
        assert_same(values(m, opt), values(ref_m, ref_opt))


def test_fallback_without_sharding_or_config_is_refused():
    class Net(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = paddle.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    net = Net()
    m, opt = ap.parallelize(net, paddle.optimizer.AdamW(1e-2, parameters=net.parameters()))
    with pytest.raises(ValueError, match="has no sharding, and the Net cannot be rebuilt"):
        ap.fallback_to_cpu_offload(m)


def test_reconfigure_distributed_model_keeps_the_trained_values():
    with ap.simulate(world_size=2):            # (simulated optimizer states are checkpointable under ZeRO)
        m, opt = make(world_stage=1)
        train(m, opt, range(2))
        before = values(m, opt)
        new = ap.Strategy()
        new.sharding.enable, new.sharding.stage = True, 3
        old_weight = dict(m.named_parameters())["wte.weight"]
        m2, opt2 = ap.reconfigure_distributed_model(m, new)        # in place: the held objects are rebuilt
        assert m2 is m and opt2 is opt and isinstance(opt, ZeroOptimizer) and opt.stage == 3
        assert dict(m.named_parameters())["wte.weight"] is not old_weight
        assert auto_checkpoint.current_run().model is m and auto_checkpoint.current_run().step == 2
        assert_same(values(m, opt), before)
        train(m, opt, range(2, 4))                                # the loop goes on with the held objects
        ref_m, ref_opt = make(world_stage=1)
        train(ref_m, ref_opt, range(4))
        assert_same(values(m, opt), values(ref_m, ref_opt))
        with pytest.raises(TypeError, match="strategy must be an ap.Strategy"):
            ap.reconfigure_distributed_model(m2, {"sharding": {"stage": 2}})


def test_checkpoint_strategy_saves_a_pipeline(tmp_path):
    with ap.simulate(world_size=2):
        s = ap.Strategy()
        s.pipeline_parallel.degree = 2
        s.checkpoint.enable, s.checkpoint.save_interval_steps, s.checkpoint.dir = True, 1, str(tmp_path)
        m = build("gpt")
        pipe, opt = ap.parallelize(m, paddle.optimizer.AdamW(1e-2, parameters=m.parameters(), epsilon=1e-4),
                                   strategy=s)
        for i in range(2):
            ids, lab = batch(i)
            pipe.train_batch(paddle.to_tensor(ids), paddle.to_tensor(lab))
            opt.step()
            opt.clear_grad()
        assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["latest", "step-00000001", "step-00000002"]
        now = values(pipe, opt)
    saved = {k: np.asarray(v) for k, v in ap.load_merged_state_dict(str(tmp_path / "step-00000002"), flat=True).items()}
    assert_same(saved, now, exact=True)
