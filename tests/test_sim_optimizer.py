"""The simulated world's optimizer step updates every rank's copy: a simulated N-rank run of several steps
equals the single-process run (the real data/tensor-parallel run computes the same global batch), checked
on every rank's local copy of every parameter; the post-step hooks of the optimizer wrappers."""

import os

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from autoparallel import layer_state
import autoparallel as ap
from autoparallel.parallel.optimizer import ShardedOptimizer
from autoparallel.testing.check import check_every_rank
from autoparallel.testing.models import adamw, batch, build, train_steps, trained_reference
from dist_scripts import shared_launch

ENTRY_POINTS = shared_launch.job(__name__, "entry_points", os.path.join(os.path.dirname(__file__), "dist_scripts",
                                                                         "entry_points_worker.py"), 4, timeout=600)

STEPS = 3


def make_opt(params):
    return adamw(params, weight_decay=0.01)


def reference(kind="gpt"):
    return trained_reference(kind, STEPS, make_opt)


def train(entry, dp, tp, kind="gpt"):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    m = build(kind)
    if entry == "Optimizer":
        opt = make_opt(m.parameters())                      # built before the wrapping, as the article does
        m = ap.DataParallel(m, strategy=s)
        opt = ap.Optimizer(opt)
    elif entry == "shard_optimizer":
        m, _ = ap.parallelize(m, None, strategy=s)
        opt = ap.shard_optimizer(make_opt(m.parameters()))
    else:
        m, opt = ap.parallelize(m, make_opt(m.parameters()), strategy=s)
    losses = train_steps(m, opt, STEPS)
    return losses, m


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("entry,dp,tp", [("Optimizer", 2, 1), ("shard_optimizer", 2, 2), ("parallelize", 4, 1)])
def test_simulated_steps_update_every_rank(ref, entry, dp, tp):
    with ap.simulate(world_size=dp * tp):
        losses, m = train(entry, dp, tp)
        np.testing.assert_allclose(losses, ref[0], rtol=1e-5, atol=1e-6)
        assert check_every_rank(m, ref[1]) == len(ref[1]) * dp * tp


def test_negative_control_only_the_lowest_rank_stepped(ref, monkeypatch):
    monkeypatch.setattr(ShardedOptimizer, "_step_other_ranks", lambda self: None)
    with ap.simulate(world_size=2):
        losses, m = train("Optimizer", 2, 1)
        assert abs(losses[1] - ref[0][1]) > 1e-4        # rank 1 computed on stale weights from step 2 on
        with pytest.raises(AssertionError):
            check_every_rank(m, ref[1])


def test_step_post_hooks_run_after_each_real_step():
    with ap.simulate(world_size=2):
        m = build("gpt")
        s = ap.Strategy()
        s.sharding.enable = True
        m, opt = ap.parallelize(m, make_opt(m.parameters()), strategy=s)
        seen = []
        handle = opt.register_step_post_hook(lambda o: seen.append((o, float(o.params[0].locals[1].sum()))))
        for i in range(2):
            ids, lab = batch(i)
            F.cross_entropy(m(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean().backward()
            before = float(dict(m.named_parameters())["wte.weight"].locals[1].sum())
            opt.step()
            opt.clear_grad()
            assert seen[-1][0] is opt and seen[-1][1] != before    # after the update, on the returned wrapper
        handle.remove()
        opt.step()
        assert len(seen) == 2
        with pytest.raises(TypeError, match="callable"):
            opt.register_step_post_hook("save")


# ---- shard_optimizer's shard_fn forms: effective (states really sharded), results unchanged ----------------
def _shard_fn_forms(mesh):
    def moments_over_data(name, param, acc):                   # paddle's accumulator hook
        return ap.shard_tensor(acc, mesh, [ap.Shard(0)] + list(param.placements)[1:])
    return {"mesh": mesh, "stage1": ap.ShardingStage1("data", mesh), "stage2": ap.ShardingStage2(0, mesh),
            "stage3": ap.ShardingStage3("data"), "callable": moments_over_data}


@pytest.mark.parametrize("form", ["mesh", "stage1", "stage2", "stage3", "callable"])
def test_shard_optimizer_forms_shard_states_and_equal_one_process(ref, form):
    with ap.simulate(world_size=2):
        m, _ = ap.parallelize(build("gpt"), None, strategy=ap.Strategy())
        opt = ap.shard_optimizer(make_opt(m.parameters()), _shard_fn_forms(layer_state.mesh_of(m))[form])
        assert opt.stage == (int(form[-1]) if form.startswith("stage") else 1)
        losses = train_steps(m, opt, STEPS)
        np.testing.assert_allclose(losses, ref[0], rtol=1e-5, atol=1e-6)
        if opt.stage == 3:
            opt.gather(opt.params)
        check_every_rank(m, ref[1])
        numel = sum(int(np.prod(p.shape)) for p in m.parameters())
        held = [_moment_elements(opt, r) for r in (0, 1)]
        assert sum(held) == numel and max(held) <= numel // 2 + len(list(m.parameters()))   # each element once
        plain = ap.shard_optimizer(make_opt(m.parameters()))               # negative control: not sharded
        assert plain.__class__ is ShardedOptimizer and not hasattr(plain, "inner_opts")


def _moment_elements(opt, rank):
    """Elements of Adam's first moment this rank holds."""
    return sum(int(t.numel()) for t in opt.inner_opts[rank]._accumulators["moment1"].values())


def test_shard_optimizer_bad_shard_fn_forms():
    with ap.simulate(world_size=2):
        m, _ = ap.parallelize(build("gpt"), None, strategy=ap.Strategy())
        mesh = layer_state.mesh_of(m)
        with pytest.raises(ValueError, match="sharding_mesh_dim='pipe' is not a dim of the mesh"):
            ap.shard_optimizer(make_opt(m.parameters()), ap.ShardingStage1("pipe", mesh))
        with pytest.raises(NotImplementedError, match="only sharding over a mesh dim the parameter is replicated"):
            ap.shard_optimizer(make_opt(m.parameters()),
                               lambda n, p, a: ap.shard_tensor(a, mesh, [ap.Partial(), ap.Replicate()]))
        with pytest.raises(TypeError, match="shard_fn must be None, ap.ShardingStage1/2/3"):
            ap.shard_optimizer(make_opt(m.parameters()), "stage1")
        plain = build("gpt")
        with pytest.raises(ValueError, match="parameters are not distributed"):
            ap.shard_optimizer(make_opt(plain.parameters()), ap.ShardingStage1(0, mesh))


def test_shard_optimizer_mesh_with_weights_already_sharded_over_data(ref):
    """The article's LLaMA hook shards q/k/v weights with ``[Shard(1)]`` (padded: over the mesh's data dim):
    those keep their states in their own sharded layout, the rest is ZeRO over data; equal to one process."""
    from autoparallel.parallel.sharding_stages import SplitOptimizer

    def shard_fn(name, layer, mesh):
        if name.endswith("attn.qkv"):
            layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(1)])

    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
        m = ap.shard_layer(build("gpt"), mesh, shard_fn)
        opt = ap.shard_optimizer(make_opt(m.parameters()), mesh)
        assert isinstance(opt, SplitOptimizer) and opt.stage == 1 and len(opt.kept.parameters) == 2
        losses = train_steps(m, opt, STEPS)
        np.testing.assert_allclose(losses, ref[0], rtol=1e-5, atol=1e-6)
        check_every_rank(m, ref[1])


@pytest.mark.parametrize("entry", ["parallelize", "Optimizer", "shard_optimizer", "negative control"])
def test_global_norm_clipping_under_tensor_parallel_equals_one_process(entry, monkeypatch):
    if entry == "negative control":                 # paddle's own clip, on each rank's shards: differs
        monkeypatch.setattr(ShardedOptimizer, "_clip_global_norm", lambda self: None)
    clip = lambda: paddle.nn.ClipGradByGlobalNorm(0.05)            # noqa: E731  (small: clipping active)
    want, ref_params = trained_reference("gpt", STEPS, lambda params: adamw(params, grad_clip=clip()))
    with ap.simulate(world_size=4):
        s = ap.Strategy()
        s.data_parallel.degree, s.tensor_parallel.degree = 2, 2
        m = build("gpt")
        opt = adamw(m.parameters(), grad_clip=clip())
        if entry in ("parallelize", "negative control"):
            m, opt = ap.parallelize(m, opt, strategy=s)
        elif entry == "Optimizer":
            m = ap.DataParallel(m, strategy=s)
            opt = ap.Optimizer(opt)
        else:
            m, _ = ap.parallelize(m, None, strategy=s)
            opt = ap.shard_optimizer(adamw(m.parameters(), grad_clip=clip()))
        got = train_steps(m, opt, STEPS)
        if entry == "negative control":
            with pytest.raises(AssertionError):
                check_every_rank(m, ref_params)
            return
        assert opt.last_grad_norm > 0.05                             # the clip was active
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        check_every_rank(m, ref_params)


def test_simulated_world_equals_real_ranks_one_launch():
    """4 real gloo ranks (one launch) vs ap.simulate(4): the same losses and every rank's parameter copy,
    for ap.DataParallel + ap.Optimizer (DP2 x TP2, global-norm clipping, use_async_allreduce) and
    shard_optimizer(ShardingStage2)."""
    from entry_points_common import run

    _, real = shared_launch.results(ENTRY_POINTS)
    assert sorted(tuple(r["world"][:2]) for r in real) == [(i, 4) for i in range(4)]
    for case in ("dp_optimizer", "stage2"):
        with ap.simulate(world_size=4):
            losses, copies = run(case)
        for r in real:
            np.testing.assert_allclose(r[case]["losses"], losses, rtol=1e-5, atol=1e-6, err_msg=case)
            for key, value in r[case]["params"].items():
                np.testing.assert_allclose(np.array(value, dtype="float32"), copies[key], rtol=1e-4, atol=2e-6,
                                           err_msg=f"{case} {key}")
        assert len(copies) == sum(len(r[case]["params"]) for r in real)      # every simulated copy compared
