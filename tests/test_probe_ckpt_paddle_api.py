"""paddle's own checkpoint calls over a model and optimizer laid out here: ``paddle.save`` / ``paddle.load`` of
``opt.state_dict()`` and of the common resume file, ``paddle.distributed.save_state_dict`` / ``load_state_dict``.
A shard is never saved as the whole: the sharded states are refused by name or gathered by the collective forms,
and every honoured form resumes as one process does (docs/checkpoints.md, "paddle's own checkpoint calls")."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.export_save import ShardedExportError
from loops2_helpers import XS, YS, Mesh2x2, One, Parallelize

SCHED = (paddle.optimizer.lr.StepDecay, dict(learning_rate=0.05, step_size=1, gamma=0.5))


def build(env):
    m = env.model()
    sched = SCHED[0](**SCHED[1])
    m, opt = env.wrap(m, paddle.optimizer.Adam(sched, parameters=m.parameters()))
    return m, opt, sched


def steps(env, m, opt, sched, start, n=2):
    out = []
    for i in range(start, start + n):
        loss = F.mse_loss(m(env.x(XS[i])), paddle.to_tensor(YS[i]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        sched.step()
        out.append(float(loss))
    return out


def run(env, load=None):
    """Two steps; with ``load`` (model state, optimizer state), those loaded first and steps 2-3 run instead.
    Built under one name guard: paddle keys optimizer states by parameter names."""
    with paddle.utils.unique_name.guard():
        m, opt, sched = build(env)
        if load is not None:
            m.set_state_dict(load[0])
            opt.set_state_dict(load[1])
        return m, opt, steps(env, m, opt, sched, 0 if load is None else 2)


@pytest.fixture(scope="module")
def one():
    m, opt, _ = run(One())
    state = (m.state_dict(), opt.state_dict())
    return {k: np.asarray(v) for k, v in opt.state_dict().items() if k != "LR_Scheduler"}, run(One(), state)[2]


ENVS = {"tp": lambda: Parallelize(tp=2), "dp x tp": lambda: Mesh2x2(), "dp": lambda: Parallelize()}


@pytest.mark.parametrize("name", list(ENVS))
def test_optimizer_state_saved_gathered_and_resumed(name, one, tmp_path):
    """paddle.save(opt.state_dict()) refuses the sharded moments by name (it wrote each rank's shard under the whole
    moment's key); ap.full_state_dict(opt) equals one process's; the file (also read with return_numpy=True)
    and the in-memory distributed state dict resume the parallel run and one process as one process resumes."""
    want_states, want_resume = one
    with ap.simulate(world_size=4):
        m, opt, _ = run(ENVS[name]())
        live = opt.state_dict()
        if name != "dp":
            with pytest.raises(ShardedExportError, match="moment1"):
                paddle.save(live, str(tmp_path / "shards.pdopt"))
        full = ap.full_state_dict(opt)
        for k, v in want_states.items():
            np.testing.assert_allclose(np.asarray(full[k]), v, rtol=1e-6, atol=1e-7, err_msg=k)
        assert full["LR_Scheduler"]["last_epoch"] == 2
        paddle.save({"model": ap.full_state_dict(m), "opt": full, "step": 2}, str(tmp_path / "run.pd"), protocol=4)
        got = run(ENVS[name](), (m.state_dict(), live))[2]              # resume from the live state dicts
        np.testing.assert_allclose(got, want_resume, rtol=1e-5)
        saved = paddle.load(str(tmp_path / "run.pd"), return_numpy=True)
        assert saved["step"] == 2 and isinstance(saved["opt"]["linear_0.w_0_moment1_0"], np.ndarray)
        got = run(ENVS[name](), (saved["model"], saved["opt"]))[2]      # a one-process file into the parallel run
        np.testing.assert_allclose(got, want_resume, rtol=1e-5)
    saved = paddle.load(str(tmp_path / "run.pd"))
    np.testing.assert_allclose(run(One(), (saved["model"], saved["opt"]))[2], want_resume, rtol=1e-5)


def test_set_state_dict_refuses_a_wrong_shape_and_a_single_shard():
    with ap.simulate(world_size=4):
        m, opt, _ = run(Parallelize(tp=2))
        full = ap.full_state_dict(opt)
        bad = dict(full, **{"linear_0.w_0_moment1_0": paddle.zeros([5, 8])})
        with pytest.raises(ValueError, match=r"linear_0.w_0_moment1_0.*\[5, 8\]"):
            opt.set_state_dict(bad)
        shard = dict(full, **{"linear_0.w_0_moment1_0": paddle.zeros([6, 4])})   # one rank's shard of [6, 8]
        with pytest.raises(NotImplementedError, match="one shard"):
            opt.set_state_dict(shard)


def test_zero_state_dict_is_distributed_and_refused_by_paddle_save(one, tmp_path):
    """ZeRO's opt.state_dict() was refused (pointing at ap.training_state); it is paddle's form now
    (tests/test_probe_zero_state_dict.py): paddle.save refuses its shards by name, the gathered one is one process's."""
    with ap.simulate(world_size=4):
        m, opt, _ = run(Mesh2x2(ap.ShardingStage2))
        with pytest.raises(ShardedExportError, match="moment1"):
            paddle.save(opt.state_dict(), str(tmp_path / "shards.pdopt"))
        full = ap.full_state_dict(opt)
    for k, v in one[0].items():
        np.testing.assert_allclose(np.asarray(full[k]), v, rtol=1e-6, atol=1e-7, err_msg=k)


def test_paddle_distributed_checkpoint_calls_load_into_another_mesh(tmp_path):
    """paddle.distributed.save_state_dict over our model's and optimizer's state dicts (the model's failed after
    writing a checkpoint without data; the optimizer's wrote shards or failed) is ap.save_state_dict's checkpoint:
    it loads into dp 4, into one process, and equals ap.save_state_dict's."""
    with ap.simulate(world_size=4), paddle.utils.unique_name.guard():
        m, opt, sched = build(Parallelize(tp=2))
        steps(Parallelize(tp=2), m, opt, sched, 0)
        want_m, want_o = ap.full_state_dict(m), ap.full_state_dict(opt)
        paddle.distributed.save_state_dict(m.state_dict(), str(tmp_path / "m"))
        paddle.distributed.save_state_dict(opt.state_dict(), str(tmp_path / "o"))
        ap.save_state_dict(opt.state_dict(), str(tmp_path / "ap_o"))
        with pytest.raises(NotImplementedError, match="safetensors"):
            paddle.distributed.save_state_dict(m.state_dict(), str(tmp_path / "x"), safetensors=True)
    for world, env in ((4, Parallelize()), (1, One())):
        with ap.simulate(world_size=world), paddle.utils.unique_name.guard():
            m2, o2, sched = build(env)
            steps(env, m2, o2, sched, 4)                      # other values, the accumulators created
            for path in ("o", "ap_o"):
                paddle.distributed.load_state_dict(m2.state_dict(), str(tmp_path / "m"))
                sd = o2.state_dict()
                paddle.distributed.load_state_dict(sd, str(tmp_path / path))
                o2.set_state_dict(sd)
                got_m, got_o = ap.full_state_dict(m2), ap.full_state_dict(o2)
                for k in want_m:
                    np.testing.assert_allclose(got_m[k].numpy(), want_m[k].numpy(), err_msg=k)
                for k in want_o:
                    if k != "LR_Scheduler":
                        np.testing.assert_allclose(np.asarray(got_o[k]), np.asarray(want_o[k]), err_msg=(path, k))


class PlainOptimizer(Mesh2x2):
    """shard_layer with paddle's optimizer left unwrapped (it steps through its implicit ShardedOptimizer)."""
    def wrap(self, m, opt):
        return m, opt


def test_plain_optimizer_over_a_sharded_layer(one):
    """The state dict of a paddle optimizer never wrapped was each rank's shard under the whole moment's key."""
    want_states, want_resume = one
    with ap.simulate(world_size=4):
        m, opt, _ = run(PlainOptimizer())
        with pytest.raises(ShardedExportError, match="moment"):
            paddle.save(opt.state_dict(), "unused.pdopt")
        full = ap.full_state_dict(opt)
        for k, v in want_states.items():
            np.testing.assert_allclose(np.asarray(full[k]), v, rtol=1e-6, atol=1e-7, err_msg=k)
        got = run(PlainOptimizer(), (ap.full_state_dict(m), full))[2]
        np.testing.assert_allclose(got, want_resume, rtol=1e-5)


def test_paddle_load_merged_state_dict_reads_the_whole_checkpoint(tmp_path):
    with ap.simulate(world_size=4), paddle.utils.unique_name.guard():
        m, opt, sched = build(Parallelize(tp=2))
        paddle.distributed.save_state_dict(m.state_dict(), str(tmp_path / "m"))
        want = ap.full_state_dict(m)
        got = paddle.distributed.load_merged_state_dict(str(tmp_path / "m"))
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k].numpy(), v.numpy(), err_msg=k)
