"""Checkpoints of every optimizer the entry points return, in the simulated world and one plain process:
``shard_optimizer(opt, mesh)``'s SplitOptimizer (weights already sharded on the data dim keep their states in
their layout, the rest ZeRO), plain data parallel's per-rank optimizer copies, ZeRO without a process group.

Each case: train 2 steps, save, train 2 more, load (every saved value comes back), train 2 again: the last two
losses and every rank's parameters equal an uninterrupted run's. Negative control: a load of the parameters
alone (optimizer states left moved on) does not."""
import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel import auto_checkpoint
from autoparallel.checkpoint.leaves import ShardedLeaf
from autoparallel.checkpoint.state import training_state
from autoparallel.dist_tensor import is_dist


def net():
    paddle.seed(0)
    return paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 4))


def x_of(i):
    return paddle.to_tensor(np.random.default_rng(i).standard_normal((4, 8)).astype("float32"))


def step(model, opt, i):
    loss = (model(x_of(i)) ** 2).mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
    return float(loss)


def leaves(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from leaves(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def values(state) -> dict:
    """{leaf name: numpy copies of every held piece} (every simulated rank's local, every ZeRO chunk box)."""
    out = {}
    for name, v in leaves(state):
        if isinstance(v, ShardedLeaf):
            out[name] = [np.array(a) for _, a in v.held_boxes()]
        elif is_dist(v):
            out[name] = [np.array(t.numpy()) for _, t in sorted(v.locals.items())]
        else:
            out[name] = [np.array(v.numpy())]
    return out


def params(model) -> list:
    return [t.numpy() for p in model.parameters() for _, t in sorted((p.locals if is_dist(p) else {0: p}).items())]


def resume(make, tmp_path, control=False, step=step):
    """(losses of steps 2, 3 after save / train on / load, parameters after them) and the uninterrupted ones."""
    model, opt = make()
    want = [step(model, opt, i) for i in range(4)]
    want_params = params(model)
    model, opt = make()
    for i in range(2):
        step(model, opt, i)
    state = training_state(model, opt)
    assert state["optimizer"], "no optimizer state named"
    ap.save_state_dict(state, str(tmp_path / "ck"))
    saved = values(state)
    for i in range(2, 4):
        step(model, opt, i)
    moved = values(training_state(model, opt))
    assert any(not np.array_equal(a, b) for k in saved for a, b in zip(saved[k], moved[k]))
    state = training_state(model, opt)
    if control:
        state = {"model": state["model"]}
    ap.load_state_dict(state, str(tmp_path / "ck"), strict=not control)
    if not control:
        back = values(training_state(model, opt))
        assert back.keys() == saved.keys()
        for k in saved:
            for a, b in zip(saved[k], back[k]):
                np.testing.assert_array_equal(a, b, err_msg=k)
    got = [step(model, opt, i) for i in range(2, 4)]
    return got, params(model), want[2:], want_params


def check(make, tmp_path, step=step):
    got, got_params, want, want_params = resume(make, tmp_path, step=step)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(got_params, want_params):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    got, _, want, _ = resume(make, tmp_path / "control", control=True, step=step)
    assert not np.allclose(got, want, rtol=1e-6), "the optimizer states did not matter: the test cannot fail"


# ---- 1. shard_optimizer(opt, mesh) with a weight already sharded on the data dim (the article's hook) ----------
def split_run():
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])

    def shard_fn(name, layer, pm):
        if name == "0":
            layer.weight = ap.shard_tensor(layer.weight, pm, [ap.Shard(1), ap.Replicate()])
        return layer

    model = ap.shard_layer(net(), mesh, shard_fn)
    opt = ap.shard_optimizer(paddle.optimizer.AdamW(1e-2, parameters=model.parameters()), mesh)
    assert type(opt).__name__ == "SplitOptimizer" and opt.zero is not None
    return model, opt


def test_split_optimizer_round_trip_and_resume(tmp_path):
    with ap.simulate(world_size=4):
        model, opt = split_run()
        state = training_state(model, opt)
        assert sorted(state["optimizer"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert [str(p) for p in state["optimizer"]["0.weight"]["moment1"].placements] == ["S(1)", "R"]
        check(split_run, tmp_path)


def assert_resumes(model, opt, tmp_path, want, fail_after, saved_at):
    """Train ``fail_after`` steps (the checkpoint strategy saving on the way, last at step ``saved_at``), then
    "fail" and resume: the run is back at step ``saved_at`` and the following steps give ``want``'s losses."""
    for i in range(fail_after):
        step(model, opt, i)
    assert (tmp_path / f"step-{saved_at:08d}").is_dir() and not (tmp_path / f"step-{fail_after:08d}").exists()
    ap.resume_from_last_checkpoint()
    assert auto_checkpoint.current_run().step == saved_at
    np.testing.assert_allclose([step(model, opt, i) for i in range(saved_at, len(want))], want[saved_at:],
                               rtol=1e-6)


def test_split_optimizer_saves_from_the_step_hook_and_resumes(tmp_path):
    """strategy.checkpoint's post-step hook (as the entry points attach it) on a SplitOptimizer."""
    with ap.simulate(world_size=4):
        model, opt = split_run()
        want = [step(model, opt, i) for i in range(4)]
        model, opt = split_run()
        strategy = ap.Strategy()
        strategy.checkpoint.enable, strategy.checkpoint.save_interval_steps = True, 2
        strategy.checkpoint.dir = str(tmp_path)
        auto_checkpoint.attach(model, opt, strategy)
        assert_resumes(model, opt, tmp_path, want, fail_after=3, saved_at=2)


def test_split_optimizer_needs_its_own_model():
    with ap.simulate(world_size=4):
        model, opt = split_run()
        with pytest.raises(ValueError, match="does not hold|not of the given"):
            training_state(net(), opt)                      # another model: its states would be lost
        assert sorted(opt.checkpoint_state()["optimizer"]) == sorted(training_state(model, opt)["optimizer"])
        # (shard_layer records the model, so the optimizer finds it without being told)


# ---- 2. plain data parallel in the simulated world: every rank's optimizer copy ----------------------------------
def dp_run(kind):
    def make():
        model = net()
        strategy = ap.Strategy()
        if kind == "momentum":
            opt = paddle.optimizer.Momentum(1e-2, momentum=0.9, parameters=model.parameters())
        else:
            opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
        if kind == "adamw-amp":                           # the AMP wrapper around the data-parallel one
            strategy.amp.enable, strategy.amp.dtype = True, "bfloat16"
        return ap.DataParallel(model, strategy=strategy), ap.Optimizer(opt)
    return make


@pytest.mark.parametrize("kind", ["adamw", "momentum", "adamw-amp"])
def test_simulated_data_parallel_round_trip_and_resume(tmp_path, kind):
    with ap.simulate(world_size=2):
        model, opt = dp_run(kind)()
        moment = training_state(model, opt)["optimizer"]["0.weight"]["velocity" if kind == "momentum" else "moment1"]
        assert sorted(moment.locals) == [0, 1] and moment.locals[0] is not moment.locals[1]
        assert (type(opt).__name__ == "AmpOptimizer") == (kind == "adamw-amp")
        check(dp_run(kind), tmp_path)


def tp_run():
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])

    def shard_fn(name, layer, pm):                       # column- then row-parallel over "model"
        if name in ("0", "2"):
            layer.weight = ap.shard_tensor(layer.weight, pm, [ap.Replicate(), ap.Shard(1 if name == "0" else 0)])
        return layer

    model = ap.shard_layer(net(), mesh, shard_fn)
    return model, ap.shard_optimizer(paddle.optimizer.AdamW(1e-2, parameters=model.parameters()))


def test_simulated_tensor_and_data_parallel_round_trip_and_resume(tmp_path):
    with ap.simulate(world_size=4):
        model, opt = tp_run()
        moment = training_state(model, opt)["optimizer"]["0.weight"]["moment1"]
        assert [str(p) for p in moment.placements] == ["R", "S(1)"] and moment.locals[1].shape == [8, 8]
        check(tp_run, tmp_path)


def test_simulated_checkpoint_loads_into_one_process(tmp_path):
    with ap.simulate(world_size=2):
        model, opt = dp_run("adamw")()
        step(model, opt, 0)
        ap.save_state_dict(training_state(model, opt), str(tmp_path / "ck"))
        want = step(model, opt, 1)
    model = net()
    opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
    ap.load_state_dict(training_state(model, opt), str(tmp_path / "ck"))
    assert step(model, opt, 1) == pytest.approx(want, rel=1e-6)


def test_simulated_checkpoint_strategy_saves_on_the_loop_and_resumes(tmp_path):
    with ap.simulate(world_size=2):
        model, opt = dp_run("adamw")()
        want = [step(model, opt, i) for i in range(6)]
        strategy = ap.Strategy()
        strategy.checkpoint.enable = True
        strategy.checkpoint.save_interval_steps = 2
        strategy.checkpoint.dir = str(tmp_path)
        model = net()
        opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
        model = ap.DataParallel(model, strategy=strategy)
        opt = ap.Optimizer(opt)
        assert_resumes(model, opt, tmp_path, want, fail_after=5, saved_at=4)


def pp_run():
    from autoparallel.testing.models import build

    strategy = ap.Strategy()
    strategy.data_parallel.degree, strategy.pipeline_parallel.degree = 2, 2
    paddle.seed(0)
    model = build("gpt")
    return ap.parallelize(model, paddle.optimizer.AdamW(1e-2, parameters=model.parameters()), strategy=strategy)


def pp_step(model, opt, i):
    from autoparallel.testing.models import batch

    ids, lab = batch(i)
    loss = float(model.train_batch(paddle.to_tensor(ids), paddle.to_tensor(lab)))
    opt.step()
    opt.clear_grad()
    return loss


def test_simulated_pipeline_round_trip_and_resume(tmp_path):
    with ap.simulate(world_size=4):
        model, opt = pp_run()
        assert type(model).__name__ == "PipelineModule"
        check(pp_run, tmp_path, step=pp_step)


# ---- 3. ZeRO in one plain process (no init_parallel_env): a world of one needs no collective -----------------------
def zero_run(stage, offload=False):
    def make():
        model = net()
        opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
        strategy = ap.Strategy()
        strategy.sharding.enable, strategy.sharding.stage = True, stage
        strategy.sharding.offload = offload
        return ap.DataParallel(model, strategy=strategy), ap.Optimizer(opt)
    return make


@pytest.mark.parametrize("stage,offload", [(1, False), (2, False), (3, False), (1, True)])
def test_zero_in_one_process_trains_like_paddle_and_resumes(tmp_path, stage, offload):
    model = net()
    ref = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
    want = [step(model, ref, i) for i in range(3)]
    model, opt = zero_run(stage, offload)()
    assert type(opt).__name__ == "ZeroOptimizer" or any(
        type(w).__name__ == "ZeroOptimizer" for w in [opt, getattr(opt, "_inner", None)])
    np.testing.assert_allclose([step(model, opt, i) for i in range(3)], want, rtol=1e-6)
    check(zero_run(stage, offload), tmp_path)
