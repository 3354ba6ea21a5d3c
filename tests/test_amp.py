"""Emulated AMP on CPU: round-trip casts at the autocast boundaries, fp32 master weights, the loss
scaler's update rules, skip-step on overflow (the 4-rank one-rank-overflow case is in test_zero_dist)."""
import dataclasses

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from autoparallel.parallel.amp import AmpOptimizer, LossScaler, apply_amp, found_inf, round_trip
from autoparallel.strategy import Strategy
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
