"""Sequence lengths that change every step and that the tensor-parallel degree does not divide (5, 9, 13, 2, 7 over
TP 4: the sequence-parallel shards are uneven, length 2 leaves two ranks empty), a batch of 1 over DP 2 (an empty
data shard), a padded first token in the attention mask, on PaddleFormers models (a dense Llama and the
DeepSeek-V3 mixture of experts) under TP 4 + SP, DP 2 x TP 2 + SP + ZeRO-2 and TP 4 + SP + recompute: every
step's loss and every parameter after 5 AdamW steps equal one process."""
import numpy as np
import pytest

from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import paddle  # noqa: E402

import autoparallel as ap  # noqa: E402

SHAPES = [(4, 5), (4, 9), (3, 13), (4, 2), (1, 7)]
_R = np.random.default_rng(0)
DATA = [(_R.integers(3, 60, s), _R.integers(3, 60, s)) for s in SHAPES]


def _train(model, opt):
    losses = []
    for ids, labels in DATA:
        mask = np.ones_like(ids)
        mask[0, :1] = 0
        out = model(input_ids=paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask),
                    labels=paddle.to_tensor(labels))
        loss = pf.loss_of(out)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def _adamw(ps):
    return paddle.optimizer.AdamW(1e-2, parameters=ps, epsilon=1e-4)


_REF = {}


def _reference(name):
    if name not in _REF:
        m = pf.build(name, 0)
        _REF[name] = (_train(m, _adamw(m.parameters())), {n: p.numpy() for n, p in m.named_parameters()})
    return _REF[name]


LAYOUTS = {"tp4-sp": (1, 4, 0, False), "dp2-tp2-sp-zero2": (2, 2, 2, False), "tp4-sp-recompute": (1, 4, 0, True)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_uneven_lengths_every_step(name, layout):
    dp, tp, zero, recompute = LAYOUTS[layout]
    want_losses, want = _reference(name)
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    s.sequence_parallel.enable, s.recompute.enable = True, recompute
    s.sharding.enable, s.sharding.stage = zero > 0, max(zero, 1)
    with ap.simulate(world_size=4):
        m = pf.build(name, 0)
        m, opt = ap.parallelize(m, _adamw(m.parameters()), strategy=s)
        losses = _train(m, opt)
        got = {n: p.full().numpy() for n, p in m.named_parameters()}
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert len(set(np.round(want_losses, 4))) == len(SHAPES)
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=2e-4, atol=3e-5, err_msg=n)
