"""PaddleFormers models under ``ap.parallelize`` in the simulated 4-rank world, driven the way a training script
drives them, against the same code on one process: functional autograd (``paddle.grad``) with recompute,
dropout, shapes that change from step to step, and the other loop forms listed in docs/model_options.md."""
import numpy as np
import pytest

from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import paddle  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel.parallel.tensor_parallel import ColWiseParallel  # noqa: E402

LR = 0.5


def strategy(dp=2, tp=2, sp=False, stage=None, recompute=False, every=1):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree, s.sequence_parallel.enable = dp, tp, sp
    if stage:
        s.sharding.enable, s.sharding.stage = True, stage
    s.recompute.enable, s.recompute.checkpoint_every_n_layers = recompute, every
    return s


def feed():
    ids, labels = pf.batch(0)
    return {"input_ids": paddle.to_tensor(ids), "labels": paddle.to_tensor(labels)}


def full(p):
    return p.full().numpy() if hasattr(p, "full") else p.numpy()


def one_process(name, loop, **cfg):
    model = pf.build(name, 0, fill_zeros=True, **cfg)
    out = loop(model, paddle.optimizer.SGD(LR, parameters=model.parameters()))
    return out, {n: p.numpy() for n, p in model.named_parameters()}


def parallel(name, loop, s, tp_plan=None, **cfg):
    with ap.simulate(world_size=4):
        model = pf.build(name, 0, fill_zeros=True, **cfg)
        opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=s, tp_plan=tp_plan)
        out = loop(model, opt)
        return out, {n: full(p) for n, p in model.named_parameters()}


def mismatched(ref, got, rtol=1e-4, atol=1e-5) -> list:
    """Names of the parameters that differ (missing, another shape or other values)."""
    return [n for n, v in ref[1].items()
            if n not in got[1] or got[1][n].shape != v.shape or not np.allclose(got[1][n], v, rtol, atol)]


def grad_step(model, opt):
    """``paddle.grad`` over every trainable parameter, then a hand-written SGD update."""
    loss = pf.loss_of(model(**feed()))
    params = [p for p in model.parameters() if not p.stop_gradient]
    for p, g in zip(params, paddle.grad(loss, params)):
        p.set_value(p - LR * g)
    return float(loss)


@pytest.mark.parametrize("name,s", [
    ("llama", strategy(recompute=True)),
    ("llama", strategy(sp=True, stage=3, recompute=True, every=2)),
    ("qwen3_moe", strategy(sp=True, recompute=True)),
], ids=["llama-recompute", "llama-sp-zero3-recompute-every2", "qwen3_moe-sp-recompute"])
def test_paddle_grad_through_recomputed_blocks_equals_one_process(name, s):
    """``paddle.grad`` runs the distributed graph in local mode; the recomputed blocks' re-run in that backward
    handed DistTensors to paddle's kernels unrouted (``rsqrt(): argument 'x' must be Tensor, but got
    DistTensor``). The re-run routes its ops as its forward did."""
    ref = one_process(name, grad_step)
    got = parallel(name, grad_step, s)
    assert np.isclose(got[0], ref[0], rtol=1e-5), (got[0], ref[0])
    assert mismatched(ref, got) == []
    assert mismatched(one_process(name, lambda m, o: 0.0), ref)      # the update moved the parameters


def fused_feed():
    ids, labels = pf.batch(0, t=7)
    labels[:, :2] = -100
    return {"input_ids": paddle.to_tensor(ids), "labels": paddle.to_tensor(labels)}


def fused_step(model, opt):
    loss = pf.loss_of(model(**fused_feed()))
    loss.backward()
    opt.step()
    return float(loss)


FUSED = {"use_fused_head_and_loss_fn": True, "loss_subbatch_sequence_length": 4}


@pytest.mark.parametrize("name,s,cfg", [
    ("llama", strategy(sp=True), dict(FUSED, tie_word_embeddings=False)),
    ("llama", strategy(sp=True), dict(FUSED, tp_plan={"lm_head": ColWiseParallel(gather_output=True)})),
    ("qwen3", strategy(dp=1, tp=4, sp=True), FUSED),
    ("llama", strategy(sp=True, stage=3, recompute=True), FUSED),
    ("qwen3_moe", strategy(dp=4, tp=1, stage=3), FUSED),
], ids=["llama-untied-sp", "llama-sp-head-gather-output", "qwen3-tp4-sp", "llama-tied-sp-zero3-recompute",
        "qwen3_moe-dp4-zero3"])
def test_fused_head_and_loss_with_sequence_parallel_and_zero3(name, s, cfg):
    """PaddleFormers' sub-batched fused head and loss: the LM head returns its (gathered) hidden states and its
    weight, and a PyLayer computes logits and loss after the head. Under sequence parallel every gradient
    upstream of the head came out tp times too large (the gathered input kept its "partial on the TP dim" mark
    outside the head); under ZeRO-3 the head's weight was released when the head returned, and the PyLayer
    failed reading it ('Tensor holds no memory')."""
    cfg = dict(cfg)
    plan = cfg.pop("tp_plan", None)
    ref = one_process(name, fused_step, **cfg)
    got = parallel(name, fused_step, s, tp_plan=plan, **cfg)
    assert np.isclose(got[0], ref[0], rtol=1e-5), (got[0], ref[0])
    assert mismatched(ref, got) == []


def eval_before_backward(model, opt):
    """The forward in train mode, an evaluation forward (the model left in eval mode), then the backward."""
    paddle.seed(5)
    loss = pf.loss_of(model(**feed()))
    model.eval()
    with paddle.no_grad():
        ids, labels = pf.batch(3)
        val = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
    loss.backward()
    opt.step()
    return float(loss), float(val)


@pytest.mark.parametrize("s", [strategy(recompute=True), strategy(sp=True, stage=3, recompute=True)],
                         ids=["recompute", "sp-zero3-recompute"])
def test_recompute_reruns_in_the_mode_of_its_forward(s):
    """With dropout, a block recomputed in backward must drop what its forward dropped. The re-run read the
    layers' ``training`` flag as the evaluation left it: no dropout in the re-run, every gradient wrong (or paddle's
    'retrieve a tensor saved by autograd multiple times' error)."""
    cfg = {"attention_dropout": 0.3}
    ref = one_process("llama", eval_before_backward, **cfg)
    got = parallel("llama", eval_before_backward, s, **cfg)
    assert np.allclose(got[0], ref[0], rtol=1e-5), (got[0], ref[0])
    assert mismatched(ref, got) == []
    assert mismatched(one_process("llama", eval_before_backward), ref)      # the dropout changes the step


OWN_RECOMPUTE = {"recompute": True, "recompute_granularity": "full", "recompute_method": "uniform",
                 "recompute_num_layers": 1}


def dropout_step(model, opt):
    paddle.seed(3)
    loss = pf.loss_of(model(**feed()))
    loss.backward()
    opt.step()
    return float(loss)


@pytest.mark.parametrize("name,s", [
    ("llama", strategy(sp=True, stage=3, recompute=True)),
    ("qwen2", strategy(recompute=True)),
], ids=["llama-sp-zero3-recompute", "qwen2-recompute"])
def test_model_own_recompute_with_strategy_recompute(name, s):
    """``config.recompute=True`` (the model's own recompute, e.g. kept from a Trainer config) together with
    ``Strategy.recompute``: the two regions nest, and paddle refused the inner one ('saved_tensors_hooks only one
    pair of hooks is allowed at a time'). A region inside another now runs plainly (the outer one recomputes it)."""
    cfg = dict(OWN_RECOMPUTE, **({"attention_dropout": 0.2} if name == "llama" else {}))
    ref = one_process(name, dropout_step, **{k: v for k, v in cfg.items() if k not in OWN_RECOMPUTE})
    got = parallel(name, dropout_step, s, **cfg)
    assert np.isclose(got[0], ref[0], rtol=1e-5), (got[0], ref[0])
    assert mismatched(ref, got) == []
