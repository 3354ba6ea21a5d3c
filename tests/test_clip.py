"""Global-norm clipping across TP / DP shards (simulated world) equals the single-process global norm; the
ZeRO path (sharded gradient chunks) is covered in test_zero_sim / test_zero_dist."""
import dataclasses

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.parallel.clip import clip_coefficient, clip_grad_norm_, global_norm
from autoparallel.parallelize import parallelize
from examples.models import PRESETS, build


def tiny():
    paddle.seed(0)
    return build(dataclasses.replace(PRESETS["gpt-tiny"], vocab_size=256))


def data():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (8, 16)), rng.integers(0, 256, (8, 16))


def reference():
    m = tiny()
    x, y = data()
    F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y)).backward()
    grads = {n: p.grad.numpy() for n, p in m.named_parameters()}
    norm = float(np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads.values())))
    return norm, grads


@pytest.mark.parametrize("dp,tp", [(4, 1), (1, 4), (2, 2)])
def test_global_norm_matches_single_process(dp, tp):
    norm, grads = reference()
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    with ap.simulate(world_size=dp * tp):
        m = tiny()
        m, opt = parallelize(m, paddle.optimizer.AdamW(parameters=m.parameters()), strategy=s)
        x, y = data()
        F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y)).backward()
        opt.reduce_gradients()
        got = clip_grad_norm_(list(m.parameters()), max_norm=norm / 4)
        assert got == pytest.approx(norm, rel=1e-5)
        for n, p in m.named_parameters():
            np.testing.assert_allclose(p.as_dist().grad.full().numpy(), grads[n] / 4, rtol=1e-4, atol=1e-7)


def test_replicated_pieces_count_once_and_bad_input():
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], ["data", "model"])
        ones = {r: paddle.ones([3]) for r in range(4)}
        assert global_norm([(ones, mesh, set())]) == pytest.approx(3 ** 0.5)          # replicated: once
        assert global_norm([(ones, mesh, {"model"})]) == pytest.approx(6 ** 0.5)      # two distinct pieces
        with pytest.raises(ValueError, match="not dims of the mesh"):
            global_norm([(ones, mesh, {"x"})])
    with pytest.raises(ValueError, match="max_norm must be positive, got 0"):
        clip_coefficient(1.0, 0)
