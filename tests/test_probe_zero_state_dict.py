"""paddle's optimizer state-dict forms under ZeRO (parallel/zero_state_dict.py), in a 4-rank simulated world
against one process (Adam over a StepDecay schedule, the MLP of loops2_helpers):

* ``opt.state_dict()`` under ZeRO-1/2/3, offload, DP x TP x ZeRO: one process's keys, the element-wise states
  distributed with Shard(0) over the sharding axis where the chunks fall on rows, ``paddle.save`` refuses them by
  name and ``ap.full_state_dict(opt)`` equals one process's state dict;
* ``opt.set_state_dict(sd)`` from the ZeRO state dict itself, a one-process state dict (tensors and numpy), a TP
  and a DP run's and another ZeRO stage's: two more steps equal one process resumed from the same state
  (negative control: a dict whose moments are zeroed resumes differently);
* ``paddle.distributed.save_state_dict(opt.state_dict(), d)`` + ``load_state_dict`` into another layout
  (ZeRO-2 -> ZeRO-3, ZeRO -> TP, ZeRO -> one process), with and without a following ``set_state_dict``
  (negative control: without the write-back into the chunks the gathered copies are loaded and dropped);
* a missing state or a wrong shape raises ValueError naming it.
"""
import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.export_save import ShardedExportError
from loops2_helpers import Mesh2x2, One, Parallelize
from test_probe_ckpt_paddle_api import build, run, steps


class Offload(Parallelize):
    """ap.parallelize over 4 data ranks, ZeRO stage 2 with the states in host memory."""
    def wrap(self, m, opt):
        s = ap.Strategy()
        s.data_parallel.degree = 4
        s.sharding.enable, s.sharding.stage, s.sharding.offload = True, 2, True
        return ap.parallelize(m, opt, strategy=s)


ZERO = {"zero1 dp x tp": lambda: Mesh2x2(ap.ShardingStage1), "zero2 dp x tp": lambda: Mesh2x2(ap.ShardingStage2),
        "zero3": lambda: Mesh2x2(ap.ShardingStage3, tp=False), "parallelize zero2": lambda: Parallelize(2),
        "parallelize zero3": lambda: Parallelize(3), "parallelize dp x tp zero2": lambda: Parallelize(2, tp=2),
        "zero2 offload": Offload}
SOURCES = {"zero2 dp x tp": ZERO["zero2 dp x tp"], "parallelize zero3": ZERO["parallelize zero3"],
           "tp": lambda: Parallelize(tp=2), "dp": lambda: Parallelize()}


@pytest.fixture(scope="module")
def one():
    """(one process's optimizer state after 2 steps as numpy, its model and optimizer state dicts, the losses of
    steps 2-3 resumed from them)."""
    m, opt, _ = run(One())
    state = (m.state_dict(), opt.state_dict())
    arrays = {k: np.asarray(v) for k, v in opt.state_dict().items() if k != "LR_Scheduler"}
    return arrays, state, run(One(), state)[2]


def _check_full(full, want):
    assert sorted(k for k in full if k != "LR_Scheduler") == sorted(want)
    for k, v in want.items():
        np.testing.assert_allclose(np.asarray(full[k]), v, rtol=1e-6, atol=1e-7, err_msg=k)
    assert full["LR_Scheduler"]["last_epoch"] == 2


@pytest.mark.parametrize("name", list(ZERO))
def test_state_dict_is_distributed_refused_by_save_and_gathers_to_one_process(name, one, tmp_path):
    want, _, _ = one
    with ap.simulate(world_size=4):
        m, opt, _ = run(ZERO[name]())
        sd = opt.state_dict()
        moments = [v for k, v in sd.items() if k.endswith("_moment1_0")]
        assert len(moments) == 4 and all(ap.is_dist(v) for v in moments)
        assert any(isinstance(v.placements[0], ap.Shard) for v in moments)     # the sharding axis (dim 0 of mesh)
        assert list(sd["linear_0.w_0_moment1_0"].shape) == [6, 8]
        with pytest.raises(ShardedExportError, match="moment"):
            paddle.save(sd, str(tmp_path / "opt.pdopt"))
        _check_full(ap.full_state_dict(opt), want)


@pytest.mark.parametrize("name", list(ZERO))
def test_set_state_dict_from_one_process_resumes_as_one_process(name, one):
    _, (model_sd, opt_sd), want = one
    as_numpy = {k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in opt_sd.items()}
    with ap.simulate(world_size=4):
        for sd in (opt_sd, as_numpy):
            np.testing.assert_allclose(run(ZERO[name](), (model_sd, sd))[2], want, rtol=1e-5)
        zeroed = {k: (v * 0 if k.endswith("moment1_0") else v) for k, v in opt_sd.items()}   # negative control
        assert not np.allclose(run(ZERO[name](), (model_sd, zeroed))[2], want, rtol=1e-5)


@pytest.mark.parametrize("src", list(SOURCES))
@pytest.mark.parametrize("dst", ["zero1 dp x tp", "zero3", "parallelize zero2", "zero2 offload"])
def test_set_state_dict_from_another_layout_resumes_as_one_process(src, dst, one):
    """The live (distributed) state dict of a ZeRO, TP or DP run, and the ZeRO run's own, into a fresh ZeRO run."""
    _, _, want = one
    with ap.simulate(world_size=4):
        m, opt, _ = run(SOURCES[src]())
        model_sd, opt_sd = ap.full_state_dict(m), opt.state_dict()
        np.testing.assert_allclose(run(ZERO[dst](), (model_sd, opt_sd))[2], want, rtol=1e-5)


def test_a_zero_run_loads_its_own_state_dict():
    with ap.simulate(world_size=4), paddle.utils.unique_name.guard():
        env = ZERO["parallelize zero2"]()
        m, opt, sched = build(env)
        steps(env, m, opt, sched, 0)
        # values are the live states where the chunks fall on rows (as paddle's are): a copy keeps this step's
        sd = {k: (v.clone() if ap.is_dist(v) else v) for k, v in opt.state_dict().items()}
        before = ap.full_state_dict(opt)
        steps(env, m, opt, sched, 2)
        opt.set_state_dict(sd)
        after = ap.full_state_dict(opt)
        for k, v in before.items():
            if k != "LR_Scheduler":
                np.testing.assert_array_equal(np.asarray(after[k]), np.asarray(v), err_msg=k)


def test_bad_state_dicts_are_refused_by_name(one):
    _, (_, opt_sd), _ = one
    with ap.simulate(world_size=4):
        _, opt, _ = run(ZERO["zero2 dp x tp"]())
        missing = {k: v for k, v in opt_sd.items() if k != "linear_1.w_0_moment2_0"}
        with pytest.raises(ValueError, match="linear_1.w_0_moment2_0"):
            opt.set_state_dict(missing)
        wrong = dict(opt_sd, **{"linear_0.w_0_moment1_0": paddle.zeros([3, 8])})     # one rank's rows
        with pytest.raises(ValueError, match=r"linear_0.w_0_moment1_0.*\[3, 8\].*\[6, 8\]"):
            opt.set_state_dict(wrong)
        with pytest.raises(TypeError, match="expects a dict"):
            opt.set_state_dict([1, 2])


@pytest.mark.parametrize("dst,world,set_after", [
    (lambda: Parallelize(3), 4, False), (lambda: Mesh2x2(ap.ShardingStage3, tp=False), 4, True),
    (lambda: Parallelize(tp=2), 4, True), (One, 1, True)])
def test_paddle_distributed_checkpoint_of_zero2_loads_into_another_layout(dst, world, set_after, tmp_path):
    """ZeRO-2 (dp x tp) -> paddle.distributed.save_state_dict(opt.state_dict()) -> load_state_dict into the state
    dict of a fresh ZeRO-3 / TP / one-process optimizer that took other steps: its states equal the saved ones
    (ZeRO-3 without set_state_dict: the load reaches the chunks by itself)."""
    with ap.simulate(world_size=4), paddle.utils.unique_name.guard():
        env = Mesh2x2(ap.ShardingStage2)
        m, opt, sched = build(env)
        steps(env, m, opt, sched, 0)
        want = ap.full_state_dict(opt)
        paddle.distributed.save_state_dict(opt.state_dict(), str(tmp_path / "o"))
    with ap.simulate(world_size=world), paddle.utils.unique_name.guard():
        env = dst()
        m2, o2, sched = build(env)
        steps(env, m2, o2, sched, 4)
        sd = o2.state_dict()
        paddle.distributed.load_state_dict(sd, str(tmp_path / "o"))
        if set_after:
            o2.set_state_dict(sd)
        got = ap.full_state_dict(o2)
    assert got["LR_Scheduler"] == want["LR_Scheduler"]
    for k, v in want.items():
        if k != "LR_Scheduler":
            np.testing.assert_allclose(np.asarray(got[k]), np.asarray(v), rtol=1e-6, err_msg=k)


def test_without_the_write_back_a_load_in_place_is_lost(tmp_path, monkeypatch):
    """Negative control of the load in place: ZeRO over 4 data ranks gathers the chunks of [6, 8] (they end inside
    rows) into copies; without writing them back the loaded values never reach the optimizer."""
    from autoparallel.parallel import zero_state_dict

    with ap.simulate(world_size=4), paddle.utils.unique_name.guard():
        env = Parallelize(2)
        m, opt, sched = build(env)
        steps(env, m, opt, sched, 0)
        want = ap.full_state_dict(opt)
        paddle.distributed.save_state_dict(opt.state_dict(), str(tmp_path / "o"))
    monkeypatch.setattr(zero_state_dict, "write_back", lambda state: None)
    with ap.simulate(world_size=4), paddle.utils.unique_name.guard():
        m2, o2, sched = build(env)
        steps(env, m2, o2, sched, 4)
        paddle.distributed.load_state_dict(o2.state_dict(), str(tmp_path / "o"))
        got = ap.full_state_dict(o2)
    assert not np.allclose(np.asarray(got["linear_0.w_0_moment1_0"]), np.asarray(want["linear_0.w_0_moment1_0"]))


def test_split_optimizer_state_dict_is_both_parts_and_resumes_as_one_process():
    """shard_optimizer(opt, mesh) with a weight already sharded on the data dim (SplitOptimizer: ZeRO over the rest,
    the kept weight's states in its layout): state_dict() holds both parts (it forwarded to the ZeRO part only)."""
    from test_checkpoint_optimizers import net, split_run, step

    def plain():
        m = net()
        return m, paddle.optimizer.AdamW(1e-2, parameters=m.parameters())

    def losses(make, load=None):
        with paddle.utils.unique_name.guard():
            m, opt = make()
            if load is not None:
                m.set_state_dict(load[0])
                opt.set_state_dict(load[1])
            got = [step(m, opt, i) for i in (range(2) if load is None else range(2, 4))]
            return m, opt, got

    m, opt, _ = losses(plain)
    one = {k: np.asarray(v) for k, v in opt.state_dict().items()}
    state = (m.state_dict(), opt.state_dict())
    want = losses(plain, state)[2]
    with ap.simulate(world_size=4):
        m, opt, _ = losses(split_run)
        full = ap.full_state_dict(opt)
        assert sorted(full) == sorted(one)
        for k, v in one.items():
            np.testing.assert_allclose(np.asarray(full[k]), v, rtol=1e-6, atol=1e-7, err_msg=k)
        np.testing.assert_allclose(losses(split_run, state)[2], want, rtol=1e-5)
        np.testing.assert_allclose(losses(split_run, (ap.full_state_dict(m), opt.state_dict()))[2], want, rtol=1e-5)


def _low_run(make_opt, stage, load=None):
    """A bfloat16 model (autoparallel.testing.precision) under ZeRO over 2 ranks, multi_precision: float32 masters."""
    from autoparallel.testing.precision import BATCHES, low_model

    with paddle.utils.unique_name.guard():
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        m = ap.shard_layer(low_model(), mesh)
        opt = ap.shard_optimizer(make_opt(m.parameters()), stage("dp", mesh))
        if load is not None:
            opt.set_state_dict(load)
        for x in BATCHES[:2]:
            m(ap.shard_tensor(paddle.to_tensor(x).astype("bfloat16"), mesh, [ap.Shard(0)])).backward()
            opt.step()
            opt.clear_grad()
        return m, opt


def test_master_weights_are_named_and_loaded_as_paddle_keeps_them(tmp_path):
    """multi_precision AdamW over bfloat16 parameters: "master_weights" {param: float32 master} and the moments keyed
    by the master's name (<param>_fp32_master_0_moment1_0), as paddle's; the master is the parameter within half a
    bfloat16 ulp; a ZeRO-3 run loads them; one process's SGD masters load too; a missing master raises."""
    adamw = lambda ps: paddle.optimizer.AdamW(0.01, parameters=ps, multi_precision=True)      # noqa: E731
    sgd = lambda ps: paddle.optimizer.SGD(0.01, parameters=ps, multi_precision=True)          # noqa: E731
    from autoparallel.testing.precision import BATCHES, low_model

    with paddle.utils.unique_name.guard():                  # one process (paddle's CPU SGD keeps masters)
        m1 = low_model()
        o1 = sgd(m1.parameters())
        m1(paddle.to_tensor(BATCHES[0]).astype("bfloat16")).backward()
        o1.step()
        one = {k: v.numpy() for k, v in o1.state_dict()["master_weights"].items()}
    with ap.simulate(world_size=2):
        m, opt = _low_run(adamw, ap.ShardingStage2)
        sd = opt.state_dict()
        names = sorted(p.name for p in m.parameters())
        assert sorted(sd["master_weights"]) == names
        assert all(f"{n}_fp32_master_0_moment1_0" in sd for n in names)
        full = ap.full_state_dict(opt)
        for p in m.parameters():
            np.testing.assert_allclose(full["master_weights"][p.name].numpy(), p.full().astype("float32").numpy(),
                                       rtol=2.0**-8, atol=1e-6)
        _, o3 = _low_run(adamw, ap.ShardingStage3)
        o3.set_state_dict(sd)
        got = ap.full_state_dict(o3)
        for k, v in full.items():
            if k == "master_weights":
                for n, w in v.items():
                    np.testing.assert_array_equal(got[k][n].numpy(), w.numpy(), err_msg=n)
            elif k != "LR_Scheduler":
                np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v), err_msg=k)
        paddle.distributed.save_state_dict(sd, str(tmp_path / "o"))         # and through a checkpoint, in place
        _, o4 = _low_run(adamw, ap.ShardingStage3)
        paddle.distributed.load_state_dict(o4.state_dict(), str(tmp_path / "o"))
        for n, w in ap.full_state_dict(o4)["master_weights"].items():
            np.testing.assert_array_equal(w.numpy(), full["master_weights"][n].numpy(), err_msg=n)
        with pytest.raises(ValueError, match=r"master_weights\['scale_0.w_0'\]"):
            o3.set_state_dict(dict(sd, master_weights={"scale_0.b_0": sd["master_weights"]["scale_0.b_0"]}))
        _, osgd = _low_run(sgd, ap.ShardingStage2)
        osgd.set_state_dict({"master_weights": {k: paddle.to_tensor(v) for k, v in one.items()}})
        back = ap.full_state_dict(osgd)["master_weights"]
        for k, v in one.items():
            np.testing.assert_array_equal(back[k].numpy(), v, err_msg=k)


def test_a_load_into_some_entries_of_the_state_dict_loads_those(tmp_path):
    """paddle.distributed.load_state_dict into a dict of some of opt.state_dict()'s entries (fc1's weight: its chunks
    end inside rows, so they are gathered copies written back): those take the saved values, the rest stay."""
    with ap.simulate(world_size=4), paddle.utils.unique_name.guard():
        env = Parallelize(2)
        m, opt, sched = build(env)
        steps(env, m, opt, sched, 0)
        want = ap.full_state_dict(opt)
        paddle.distributed.save_state_dict(opt.state_dict(), str(tmp_path / "o"))
    with ap.simulate(world_size=4), paddle.utils.unique_name.guard():
        m2, o2, sched = build(env)
        steps(env, m2, o2, sched, 4)
        before = ap.full_state_dict(o2)
        some = {k: v for k, v in o2.state_dict().items() if k.startswith("linear_0.w_0_moment")}
        paddle.distributed.load_state_dict(some, str(tmp_path / "o"))
        got = ap.full_state_dict(o2)
    for k in want:
        if k != "LR_Scheduler":
            ref = want[k] if k in some else before[k]
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(ref), err_msg=k)
    assert not np.allclose(np.asarray(before["linear_0.w_0_moment1_0"]), np.asarray(want["linear_0.w_0_moment1_0"]))
