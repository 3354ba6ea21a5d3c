"""A PaddleFormers causal LM trained a few steps and then asked to ``generate`` (greedy, 4 new tokens, with its
cache) in the same program, against one process: under DP 2 x TP 2 with ZeRO-3 (the parameters held as chunks
between steps), TP 4 with sequence parallelism and DP 4 with ZeRO-3: the training losses, the generated tokens,
and training resumed after ``model.eval()`` / ``model.train()`` (losses of 2 more steps)."""
import numpy as np
import pytest

from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import paddle  # noqa: E402

import autoparallel as ap  # noqa: E402


def _train(model, opt, seeds):
    losses = []
    for i in seeds:
        ids, labels = pf.batch(i)
        loss = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def _generate(model):
    model.eval()
    prompts = paddle.to_tensor(np.random.default_rng(3).integers(3, 60, (4, 6)).astype("int64"))
    out = model.generate(input_ids=prompts, max_new_tokens=4, use_cache=True, decode_strategy="greedy_search")
    out = out[0] if isinstance(out, (tuple, list)) else out
    model.train()
    return out.full().numpy() if hasattr(out, "full") else out.numpy()


def _adamw(ps):
    return paddle.optimizer.AdamW(1e-2, parameters=ps, epsilon=1e-4)


def _session(model, opt):
    return _train(model, opt, [0, 1]), _generate(model), _train(model, opt, [2, 3])


_REF = []


def _reference():
    if not _REF:
        m = pf.build("llama", 0)
        _REF.append(_session(m, _adamw(m.parameters())))
    return _REF[0]


@pytest.mark.parametrize("dp,tp,zero,sp", [(2, 2, 3, False), (1, 4, 0, True), (4, 1, 3, False)])
def test_generate_between_training_steps_equals_one_process(dp, tp, zero, sp):
    before, tokens, after = _reference()
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    s.sharding.enable, s.sharding.stage = zero > 0, max(zero, 1)
    s.sequence_parallel.enable = sp
    with ap.simulate(world_size=4):
        m = pf.build("llama", 0)
        m, opt = ap.parallelize(m, _adamw(m.parameters()), strategy=s)
        got = _session(m, opt)
    np.testing.assert_allclose(got[0], before, rtol=1e-5)
    np.testing.assert_array_equal(got[1], tokens)
    assert tokens.shape == (4, 4)                     # the new tokens only
    np.testing.assert_allclose(got[2], after, rtol=1e-4)


def test_the_generated_tokens_depend_on_the_training():
    """The control: the untrained model generates other tokens, so the equality above reads trained weights."""
    untrained = _generate(pf.build("llama", 0))
    assert not np.array_equal(untrained, _reference()[1])
