"""Recompute forms with dropout p > 0 and ``paddle.seed`` fixed, in the simulated world: the loss, every gradient
and the losses of a few steps equal one process without recompute (masks drawn at the global shape; the re-run in
backward redraws the same mask and leaves the generator where one process leaves it). Forms: the Strategy's
recompute, ``ap.recompute_layers``, ``paddle.distributed.fleet.utils.recompute`` called in a user's forward
(reentrant and not, arguments nested in dicts and lists), a PaddleFormers model's own ``config.recompute``;
under DP, TP + SP, ZeRO-1/2/3 (with ``opt.reduce_gradients()`` called before ``opt.step()``); ``model.eval()``; negative control ``preserve_rng_state=False``."""
import dataclasses

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest
from paddle.distributed.fleet.utils import recompute as fleet_recompute

import autoparallel as ap
from autoparallel.parallel.recompute import apply_ac, recompute_layers
from autoparallel.testing.paddleformers_models import _grad_np
from examples.models import PRESETS, build


def gpt(p=0.1):
    paddle.seed(0)
    return build(dataclasses.replace(PRESETS["gpt-tiny"], vocab_size=64, layers=2, max_positions=16, dropout=p))


def data(vocab=64):
    rng = np.random.default_rng(0)
    return paddle.to_tensor(rng.integers(0, vocab, (4, 16))), paddle.to_tensor(rng.integers(0, vocab, (4, 16)))


def user_recompute(model, **kw):
    """Every block's forward through ``fleet.utils.recompute(forward, *args, **kw)``, as a user writes it."""
    for block in model.blocks:
        block.forward = (lambda f: lambda *a: fleet_recompute(f, *a, **kw))(block.forward)
    return model


def strategy(dp=2, tp=1, sp=False, rc=None, every=1, zero=0):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree, s.sequence_parallel.enable = dp, tp, sp
    if zero:
        s.sharding.enable, s.sharding.stage = True, zero
    if rc:
        s.recompute.enable, s.recompute.granularity, s.recompute.checkpoint_every_n_layers = True, rc, every
    return s


def step(model, s=None, steps=1, eval_=False):
    """(losses of ``steps`` SGD steps + the generator's next draw, gradients of the first backward)."""
    if eval_:
        model.eval()
    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    if s is not None:
        model, opt = ap.parallelize(model, opt, strategy=s)
    x, y = data()
    paddle.seed(123)
    losses, grads = [], None
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if s is not None:
            opt.reduce_gradients()
        grads = grads or {n: _grad_np(p) for n, p in model.named_parameters()}
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses + [float(paddle.rand([1]))], grads


def assert_same(got, ref):
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for k, g in ref[1].items():
        np.testing.assert_allclose(got[1][k], g, rtol=1e-4, atol=1e-6, err_msg=k)


FORMS = {
    "strategy full": lambda: (gpt(), strategy(rc="full")),
    "strategy full every 2": lambda: (gpt(), strategy(rc="full", every=2)),
    "strategy selective": lambda: (gpt(), strategy(rc="selective")),
    "recompute_layers predicate": lambda: (recompute_layers(gpt(), lambda l: type(l).__name__ == "Block", 2),
                                           strategy()),
    "user reentrant": lambda: (user_recompute(gpt(), use_reentrant=True), strategy()),
    "user non-reentrant": lambda: (user_recompute(gpt(), use_reentrant=False), strategy()),
    "tp2 + sp, strategy full": lambda: (gpt(), strategy(dp=1, tp=2, sp=True, rc="full")),
    # the steps call opt.reduce_gradients() before opt.step(): ZeRO's step used to find no gradient then
    "zero1, strategy full": lambda: (gpt(), strategy(rc="full", zero=1)),
    "zero2, user reentrant": lambda: (user_recompute(gpt(), use_reentrant=True), strategy(zero=2)),
    "zero3, strategy full": lambda: (gpt(), strategy(rc="full", zero=3)),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_dropout_under_recompute_equals_one_process(form):
    ref = step(gpt(), steps=3)
    with ap.simulate(world_size=2):
        got = step(*FORMS[form](), steps=3)
    if form.startswith("zero"):         # ZeRO-2/3 keep gradient chunks only: the losses of the steps tell
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    else:
        assert_same(got, ref)


def test_negative_control_recompute_without_rng_preservation_redraws_the_mask():
    """preserve_rng_state=False: the re-run draws another mask, in one process as in the simulated world."""
    ref = step(gpt())
    same_form = step(user_recompute(gpt(), preserve_rng_state=False))
    assert max(float(np.abs(same_form[1][k] - g).max()) for k, g in ref[1].items()) > 1e-3
    with ap.simulate(world_size=2):
        assert_same(step(user_recompute(gpt(), use_reentrant=False, preserve_rng_state=False), strategy()), same_form)


def test_eval_disables_dropout_under_recompute():
    ref = step(gpt(0.0))
    with ap.simulate(world_size=2):
        assert_same(step(gpt(), strategy(rc="full"), eval_=True), ref)
        train_mode = step(gpt(), strategy(rc="full"))
    assert abs(train_mode[0][0] - ref[0][0]) > 1e-5            # dropout does act in training mode


class Nested(nn.Layer):
    """A block whose activation reaches ``fleet.utils.recompute`` inside a dict or a nested list."""

    def __init__(self, form):
        super().__init__()
        self.emb, self.fc, self.head = nn.Embedding(64, 16), nn.Linear(16, 16), nn.Linear(16, 64)
        self.form = form

    def block(self, arg):
        h = arg["h"] if "dict" in self.form else arg[0][0]
        return F.dropout(F.gelu(self.fc(h)), 0.3)

    def forward(self, ids):
        h = self.emb(ids)
        arg = {"h": h} if "dict" in self.form else [[h]]
        plain = self.form.startswith("none")
        return self.head(self.block(arg) if plain else fleet_recompute(self.block, arg, use_reentrant=True))


@pytest.mark.parametrize("form", ["dict", "list"])
def test_reentrant_recompute_of_nested_distributed_arguments(form):
    """Was paddle's "At least one output of PyLayer.forward is a Tensor"; now the gradients of the block
    without recompute (one process's reentrant recompute drops them: it tracks top-level tensors only)."""
    paddle.seed(0)
    ref = step(Nested("none-" + form))
    with ap.simulate(world_size=2):
        paddle.seed(0)
        assert_same(step(Nested(form), strategy()), ref)


def test_paddleformers_llama_own_recompute_with_attention_dropout():
    from autoparallel.testing import paddleformers_models as pf

    if not pf.available():
        pytest.skip("paddleformers not installed (pip install -e .[models])")

    def run(s=None, **overrides):
        model = pf.build("llama", fill_zeros=True, **{"attention_dropout": 0.2, **overrides})
        opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
        if s is not None:
            model, opt = ap.parallelize(model, opt, strategy=s)
        ids, labels = pf.batch(0)
        paddle.seed(7)
        loss = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
        loss.backward()
        if s is not None:
            opt.reduce_gradients()
        return [float(loss)], {n: _grad_np(p) for n, p in model.named_parameters()}

    ref = run()
    assert abs(ref[0][0] - run(attention_dropout=0.0)[0][0]) > 1e-3      # the dropout acts
    with ap.simulate(world_size=4):
        assert_same(run(strategy(dp=2, tp=2), recompute=True, recompute_granularity="full"), ref)
        assert_same(run(strategy(dp=2, tp=2, sp=True, rc="selective")), ref)


@pytest.mark.parametrize("overlap", [True, False])
def test_zero1_reduce_gradients_before_step_reduces_once(overlap):
    """``reduce_gradients()`` then ``step()``: without backward hooks (overlap=False) the step's own reduction
    summed the already reduced stage-1 gradients a second time."""
    from autoparallel import layer_state
    from autoparallel.parallel.sharding import apply_zero

    ref = step(gpt(0.0), steps=3)[0][:3]
    with ap.simulate(world_size=2):
        model = gpt(0.0)
        model, opt = ap.parallelize(model, paddle.optimizer.SGD(0.1, parameters=model.parameters()), strategy=strategy())
        zopt = apply_zero(model, opt, layer_state.mesh_of(model), 1, overlap=overlap)
        x, y = data()
        losses = []
        for _ in range(3):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            zopt.reduce_gradients()
            zopt.step()
            zopt.clear_grad()
            losses.append(float(loss))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
