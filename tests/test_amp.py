"""Emulated AMP on CPU: round-trip casts at the autocast boundaries, fp32 master weights, the loss
scaler's update rules, skip-step on overflow (the 4-rank one-rank-overflow case is in test_zero_dist)."""
import dataclasses

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from autoparallel.parallel.amp import AmpOptimizer, LossScaler, apply_amp, found_inf, round_trip
from autoparallel.strategy import Strategy
from autoparallel.testing.check import check_every_rank
from autoparallel.testing.gpu_scaler import gpu_grad_scaler
from autoparallel.testing.models import adamw, trained_reference
from examples.models import PRESETS, build


def tiny():
    paddle.seed(0)
    return build(dataclasses.replace(PRESETS["gpt-tiny"], vocab_size=256))


def test_round_trip_rounds_to_low_precision():
    x = paddle.to_tensor([1.0 + 2.0**-10, 70000.0], dtype="float32")
    assert round_trip(x, "bfloat16").numpy()[0] == 1.0             # 8 mantissa bits
    assert np.isinf(round_trip(x, "float16").numpy()[1])            # beyond fp16's range
    assert round_trip(x, "float16").dtype == paddle.float32


def test_scaler_rules():
    s = LossScaler(1024.0, incr_ratio=2.0, decr_ratio=0.5, incr_every_n_steps=3, decr_every_n_nan_or_inf=2)
    trace = []
    for inf in [False, False, False, True, False, True, True, True, True]:
        s.update(inf)
        trace.append(s.scale_value)
    assert trace == [1024, 1024, 2048, 2048, 2048, 2048, 1024, 1024, 512]
    static = LossScaler(8.0, use_dynamic_loss_scaling=False)
    static.update(True)
    assert static.scale_value == 8.0
    tiny_scale = LossScaler(1.0, decr_every_n_nan_or_inf=1)
    tiny_scale.update(True)
    assert tiny_scale.scale_value == 1.0                               # never below 1
    s = Strategy()
    s.amp.enable, s.amp.dtype = True, "bfloat16"
    assert LossScaler.from_strategy(s.amp).scale_value == 1.0


def test_scaler_bad_input():
    with pytest.raises(ValueError, match="decr_ratio must be in \\(0, 1\\), got 2"):
        LossScaler(decr_ratio=2)
    with pytest.raises(ValueError, match="amp dtype must be one of"):
        apply_amp(tiny(), "float8")


def test_emulated_training_master_weights_and_skip():
    m = tiny()
    ref = tiny()
    apply_amp(m, "bfloat16")
    rng = np.random.default_rng(0)
    x, y = paddle.to_tensor(rng.integers(0, 256, (4, 16))), paddle.to_tensor(rng.integers(0, 256, (4, 16)))
    l_amp = float(F.cross_entropy(m(x), y))
    l_ref = float(F.cross_entropy(ref(x), y))
    assert l_amp != l_ref and abs(l_amp - l_ref) < 2e-2                 # rounded, but close
    opt = AmpOptimizer(paddle.optimizer.AdamW(1e-3, parameters=m.parameters()), LossScaler(2.0**8))
    loss = F.cross_entropy(m(x), y)
    opt.scale(loss).backward()
    g_scaled = m.lm_head.weight.grad.numpy().copy()
    assert opt.step()                                                # finite: the step runs on unscaled grads
    np.testing.assert_allclose(m.lm_head.weight.grad.numpy(), g_scaled / 2.0**8, rtol=1e-6)
    assert all(p.dtype == paddle.float32 for p in m.parameters())    # master weights stay fp32
    opt.clear_grad()
    loss = F.cross_entropy(m(x), y)
    opt.scale(loss).backward()
    m.ln_f.weight.grad.set_value(paddle.full_like(m.ln_f.weight.grad, float("nan")))
    before = {n: p.numpy().copy() for n, p in m.named_parameters()}
    assert found_inf(list(m.parameters()))
    assert not opt.step() and opt.skipped == 1
    assert all(np.array_equal(p.numpy(), before[n]) for n, p in m.named_parameters())


def test_fp16_gradient_overflow_is_caught():
    m = tiny()
    apply_amp(m, "float16")
    opt = AmpOptimizer(paddle.optimizer.AdamW(1e-3, parameters=m.parameters()), LossScaler(2.0**30))
    rng = np.random.default_rng(0)
    x, y = paddle.to_tensor(rng.integers(0, 256, (4, 16))), paddle.to_tensor(rng.integers(0, 256, (4, 16)))
    opt.scale(F.cross_entropy(m(x), y)).backward()                   # a scale of 2^30 overflows fp16 gradients
    assert not opt.step()
    assert opt.scaler.scale_value == 2.0**30 and opt.scaler.bad_steps == 1


# ---- paddle.amp.GradScaler + auto_cast over distributed losses (the article's mixed-precision snippet) ----
def _scaler_run(world, sharding=0, steps=3, poison=None):
    """Train the test GPT with GradScaler(1024) + auto_cast; ``poison=(step, rank)`` puts an inf into that
    rank's local gradient after backward. Returns losses, scales, hook count and the model."""
    import autoparallel as ap
    from autoparallel.testing.models import batch
    from autoparallel.testing.models import build as build_test

    losses, scales, hooks = [], [], []
    with ap.simulate(world_size=world):
        s = Strategy()
        if sharding:
            s.sharding.enable, s.sharding.stage = True, sharding
        m = build_test("gpt")
        m, opt = ap.parallelize(m, adamw(m.parameters()), strategy=s)
        opt.register_step_post_hook(lambda o: hooks.append(1))
        scaler = gpu_grad_scaler(init_loss_scaling=1024)
        for i in range(steps):
            ids, lab = batch(i)
            with paddle.amp.auto_cast():
                loss = F.cross_entropy(m(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()
            scaled = scaler.scale(loss)
            scaled.backward()
            if poison is not None and poison[0] == i:
                g = dict(m.named_parameters())["lm_head.weight"].locals[poison[1]].grad
                g.set_value(paddle.full_like(g, float("inf")))
            scaler.step(opt)
            scaler.update()
            opt.clear_grad()
            losses.append(float(loss))
            scales.append(float(scaler._scale))
        return losses, scales, len(hooks), m


@pytest.mark.parametrize("sharding", [0, 2])
def test_grad_scaler_on_a_distributed_loss_equals_one_process(sharding):
    ref_losses, ref_params = trained_reference("gpt")
    losses, scales, hooks, m = _scaler_run(2, sharding)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert scales == [1024.0] * 3 and hooks == 3
    check_every_rank(m, ref_params)


def test_an_inf_on_one_rank_skips_the_step_on_every_rank():
    ref_losses, _ = trained_reference("gpt", 1)
    losses, scales, hooks, m = _scaler_run(2, sharding=2, steps=2, poison=(0, 1))
    assert scales == [512.0, 512.0] and hooks == 1          # step 0 skipped (scale halved), step 1 ran
    assert losses[0] == pytest.approx(ref_losses[0], rel=1e-6)
    from autoparallel.testing.models import build as build_test

    init = {n: p.numpy() for n, p in build_test("gpt").named_parameters()}
    w = dict(m.named_parameters())["wte.weight"]
    assert all(np.isfinite(t.numpy()).all() for t in w.locals.values())
    assert np.array_equal(w.locals[0].numpy(), w.locals[1].numpy())      # the ranks stayed identical
    assert not np.array_equal(w.locals[0].numpy(), init["wte.weight"])   # and step 1 trained them


def test_paddle_scaler_alone_fails_on_a_distributed_loss(monkeypatch):
    """Negative control: without the bridge paddle's scaler cannot scale a DistTensor loss."""
    import autoparallel as ap
    from autoparallel.parallel import amp_scaler
    from autoparallel.testing.models import batch
    from autoparallel.testing.models import build as build_test

    base = paddle.amp.grad_scaler.AmpScaler.__dict__["scale"].__closure__
    original = next(c.cell_contents for c in base if callable(c.cell_contents)
                    and getattr(c.cell_contents, "__name__", "") == "scale")
    monkeypatch.setattr(paddle.amp.GradScaler, "scale", original)
    assert amp_scaler._installed
    with ap.simulate(world_size=2):
        m = build_test("gpt")
        m, opt = ap.parallelize(m, adamw(m.parameters()))
        ids, lab = batch(0)
        loss = F.cross_entropy(m(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()
        with pytest.raises((NotImplementedError, TypeError), match="_is_initialized"):
            gpu_grad_scaler(init_loss_scaling=1024).scale(loss)


def test_grad_scaler_unscale_then_step_and_two_scalers_refused():
    import autoparallel as ap
    from autoparallel.testing.models import batch
    from autoparallel.testing.models import build as build_test

    with ap.simulate(world_size=2):
        m = build_test("gpt")
        m, opt = ap.parallelize(m, adamw(m.parameters()))
        scaler = gpu_grad_scaler(init_loss_scaling=1024)
        ids, lab = batch(0)
        scaler.scale(F.cross_entropy(m(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()).backward()
        w = dict(m.named_parameters())["lm_head.weight"]
        scaled = {r: t.grad.numpy().copy() for r, t in w.locals.items()}
        scaler.unscale_(opt)                                   # e.g. to clip by hand before the step
        for r, t in w.locals.items():
            np.testing.assert_allclose(t.grad.numpy(), scaled[r] / 1024, rtol=1e-6)
        with pytest.raises(RuntimeError, match="already been called"):
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    with ap.simulate(world_size=2):
        s = Strategy()
        s.amp.enable, s.amp.dtype = True, "float16"
        m = build_test("gpt")
        m, opt = ap.parallelize(m, adamw(m.parameters()), strategy=s)
        scaler = gpu_grad_scaler(init_loss_scaling=1024)
        scaler.scale(F.cross_entropy(m(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()).backward()
        with pytest.raises(ValueError, match="use one loss scaler"):
            scaler.step(opt)


def test_grad_scaler_over_shard_optimizer_with_a_mesh_equals_one_process():
    """The article's shard_optimizer(opt, mesh) (ZeRO over the data dim for replicated weights, the rest in
    their sharded layout) under GradScaler: every gradient of both parts unscaled."""
    import autoparallel as ap
    from autoparallel.testing.check import expected_local
    from autoparallel.testing.models import batch
    from autoparallel.testing.models import build as build_test

    ref = build_test("gpt")
    ref_opt = adamw(ref.parameters())
    ids, lab = batch(0)
    F.cross_entropy(ref(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean().backward()
    ref_opt.step()

    def shard_fn(name, layer, mesh):
        if name.endswith("attn.qkv"):
            layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(1)])     # on the data dim

    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
        m = ap.shard_layer(build_test("gpt"), mesh, shard_fn)
        opt = ap.shard_optimizer(adamw(m.parameters()), mesh)
        assert type(opt).__name__ == "SplitOptimizer"
        scaler = gpu_grad_scaler(init_loss_scaling=1024)
        scaler.scale(F.cross_entropy(m(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()).backward()
        scaler.step(opt)
        scaler.update()
        z = getattr(opt, "zero", None)
        if z is not None:
            z.gather(z.params)
        for name, p in ref.named_parameters():
            got = dict(m.named_parameters())[name]
            for r, t in got.locals.items():
                np.testing.assert_allclose(t.numpy(), expected_local(p.numpy(), got.spec, got.mesh.coords_of(r)),
                                           rtol=1e-4, atol=2e-5, err_msg=f"{name} rank {r}")
