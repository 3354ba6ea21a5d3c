"""Pipelines driven the way users drive them, in one process, against the unsplit model: model keyword inputs
(attention masks, position ids) through the stages, blocks returning tuples and taking keyword inputs, labels
with -100 (the PaddleFormers models' own loss), eval_batch and a train step after it, clear_gradients, schedules
with fewer / as many / more micro-batches than stages, and the refusals (a model's own auxiliary loss, labels
that do not fit the logits, a tuple of model inputs read as micro-batches)."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as ap
from autoparallel.parallel.pipeline import auto_split
from autoparallel.parallel.pipeline.runtime import apply_pp
from autoparallel.testing import paddleformers_models as pf

VOCAB = 128


class Block(nn.Layer):
    """Takes the mask and positions as keyword inputs and returns ``(hidden, cache)``, as decoder layers do."""

    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None):
        keep = attention_mask.unsqueeze(-1).astype("float32")
        h = hidden_states + paddle.tanh(self.fc(hidden_states)) * keep + 0.01 * position_ids.unsqueeze(-1).astype("float32")
        return h, past_key_values


class KwargsModel(nn.Layer):
    def __init__(self, d=16, layers=3):
        super().__init__()
        paddle.seed(0)
        self.emb = nn.Embedding(VOCAB, d)
        self.layers = nn.LayerList([Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None):
        if attention_mask is None:
            attention_mask = paddle.ones_like(input_ids)
        if position_ids is None:
            position_ids = paddle.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)
        h = self.emb(input_ids)
        for layer in self.layers:
            h, _ = layer(h, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values)
        return {"logits": self.head(h)}


def batch(step, b=4, t=8):
    rng = np.random.default_rng(step)
    ids, labels = rng.integers(0, VOCAB, (b, t)), rng.integers(0, VOCAB, (b, t))
    mask = np.ones((b, t), "int64")
    mask[0, 5:] = 0
    mask[b - 1, 3:] = 0
    return {"input_ids": paddle.to_tensor(ids), "attention_mask": paddle.to_tensor(mask)}, labels


def strategy(pp=2, schedule="1F1B", micro_batches=2, vpp=1):
    s = ap.Strategy()
    s.pipeline_parallel.degree, s.pipeline_parallel.schedule = pp, schedule
    s.pipeline_parallel.micro_batches, s.pipeline_parallel.vpp_degree = micro_batches, vpp
    return s


def one_process(build, batches, loss_of):
    model = build()
    opt = paddle.optimizer.SGD(0.5, parameters=model.parameters())
    losses = []
    for inputs, labels in batches:
        loss = loss_of(model, inputs, paddle.to_tensor(labels))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: p.numpy() for n, p in model.named_parameters()}


def pipelined(build, batches, s, **kw):
    model = build()
    opt = paddle.optimizer.SGD(0.5, parameters=model.parameters())
    pipe = apply_pp(model, s, **kw)
    opt = pipe.wrap_optimizer(opt)
    losses = []
    for inputs, labels in batches:
        losses.append(pipe.train_batch(inputs, labels))
        opt.step()
        opt.clear_grad()
    return losses, dict((n, p.numpy()) for n, p in pipe.named_parameters())


def assert_equal_runs(want, got, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(got[0], want[0], rtol=rtol, atol=atol)
    assert set(got[1]) == set(want[1])
    for n, v in want[1].items():
        np.testing.assert_allclose(got[1][n], v, rtol=rtol, atol=atol, err_msg=n)


def ce(model, inputs, labels):
    return F.cross_entropy(auto_split.model_output(model(**inputs)), labels)


@pytest.mark.parametrize("pp,schedule,micro_batches,vpp", [
    (2, "FThenB", 1, 1), (3, "FThenB", 2, 1), (2, "1F1B", 2, 1), (3, "1F1B", 4, 1), (2, "ZB-H1", 4, 1),
    (2, "VPP", 2, 2)])
def test_keyword_inputs_and_tuple_blocks_under_every_schedule(pp, schedule, micro_batches, vpp):
    """An attention mask and positions given as a dict reach every stage's blocks; blocks return (hidden, cache)
    and the model a dict; micro-batches fewer than, as many as and more than the stages; 3 layers on 2 stages."""
    layers = 4 if vpp > 1 else 3
    build = lambda: KwargsModel(layers=layers)  # noqa: E731
    batches = [batch(i, b=4) for i in range(2)]
    want = one_process(build, batches, ce)
    assert_equal_runs(want, pipelined(build, batches, strategy(pp, schedule, micro_batches, vpp)))


def test_negative_control_the_mask_matters():
    build = KwargsModel
    batches = [batch(i) for i in range(2)]
    want = one_process(build, batches, ce)
    unmasked = [({"input_ids": b[0]["input_ids"]}, b[1]) for b in batches]
    with pytest.raises(AssertionError):
        assert_equal_runs(want, pipelined(build, unmasked, strategy()))


def test_too_few_micro_batches_for_1f1b_is_refused():
    with pytest.raises(ValueError, match="needs at least pipeline_parallel.degree=2 micro-batches"):
        apply_pp(KwargsModel(), strategy(schedule="1F1B", micro_batches=1))


def llama(**kw):
    return pf.build("llama", **{"num_hidden_layers": 3, **kw})


def own_loss(model, inputs, labels):
    return pf.loss_of(model(**inputs, labels=labels))


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_labels_with_minus_100_give_the_models_own_loss(micro_batches):
    """Unevenly many ignored labels per micro-batch: the default loss is the mean over the labels not -100 of the
    whole batch, i.e. ``model(..., labels=...).loss`` of one process (paddle's F.cross_entropy would divide by
    every label)."""
    batches = []
    for i in range(2):
        inputs, labels = batch(i)
        labels[0, :] = -100
        labels[1, :6] = -100
        batches.append((inputs, labels))
    want = one_process(llama, batches, own_loss)
    assert_equal_runs(want, pipelined(llama, batches, strategy(micro_batches=micro_batches)), rtol=1e-4, atol=2e-5)
    paddles = one_process(llama, batches, ce)                # F.cross_entropy's mean: another value
    assert abs(paddles[0][0] - want[0][0]) > 0.5
    # a user loss_fn is a per-micro-batch mean: F.cross_entropy given as loss_fn gives paddle's value
    got = pipelined(llama, batches, strategy(micro_batches=micro_batches), loss_fn=F.cross_entropy)
    assert_equal_runs(paddles, got, rtol=1e-4, atol=2e-5)


def test_eval_batch_then_train_step():
    """eval_batch: the unsplit model's logits and loss, no gradient, and the train
    step after it equals one without the evaluation."""
    inputs, labels = batch(0)
    ref = llama()
    ref.eval()
    with paddle.no_grad():
        want_logits = auto_split.model_output(ref(**inputs)).numpy()
        want_loss = float(own_loss(ref, inputs, paddle.to_tensor(labels)))
    pipe = apply_pp(llama(), strategy())
    pipe.eval()
    np.testing.assert_allclose(pipe.eval_batch(inputs).numpy(), want_logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pipe.eval_batch(inputs, labels), want_loss, rtol=1e-5)
    assert all(p.grad is None for p in pipe.parameters())
    pipe.train()
    batches = [batch(1)]
    want = one_process(llama, batches, ce)
    opt = pipe.wrap_optimizer(paddle.optimizer.SGD(0.5, parameters=pipe.parameters()))
    losses = [pipe.train_batch(*batches[0])]
    opt.step()
    assert_equal_runs(want, (losses, dict((n, p.numpy()) for n, p in pipe.named_parameters())), 1e-4, 2e-5)


def test_clear_gradients_on_the_pipeline():
    pipe = apply_pp(KwargsModel(), strategy())
    pipe.train_batch(*batch(0))
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in pipe.parameters())
    pipe.clear_gradients()
    assert all(p.grad is None or float(p.grad.abs().sum()) == 0 for p in pipe.parameters())


@pytest.mark.parametrize("name,overrides", [
    ("qwen2", {}), ("qwen3", {"tie_word_embeddings": True}), ("qwen2_moe", {}), ("qwen3_moe", {}),
    ("deepseek_v3", {}), ("gemma3", {"sliding_window": 4}), ("phi3", {"tie_word_embeddings": True})])
def test_paddleformers_families_on_two_stages(name, overrides):
    """Three layers on two stages (not divisible), each family's own loss as the reference."""
    build = lambda: pf.build(name, num_hidden_layers=3, **overrides)  # noqa: E731
    batches = [({"input_ids": batch(i)[0]["input_ids"]}, batch(i)[1]) for i in range(2)]
    want = one_process(build, batches, own_loss)
    assert_equal_runs(want, pipelined(build, batches, strategy()), rtol=1e-4, atol=2e-5)


def test_a_models_own_auxiliary_loss_is_refused():
    with pytest.raises(NotImplementedError, match="output_router_logits=True"):
        apply_pp(pf.build("qwen2_moe", num_hidden_layers=2, output_router_logits=True), strategy())


def test_inputs_that_cannot_be_honoured_raise():
    pipe = apply_pp(llama(), strategy())
    inputs, labels = batch(0)
    with pytest.raises(ValueError, match="labels: a micro-batch of labels has shape \\[2, 5\\]"):
        pipe.train_batch(inputs, labels[:, :5])
    with pytest.raises(ValueError, match="inputs holds 4 samples but each of the labels 2"):
        pipe.train_batch((inputs["input_ids"], inputs["attention_mask"]), labels)
    with pytest.raises(ValueError, match="must divide into micro_batches x data-parallel degree = 2 x 1"):
        pipe.train_batch({"input_ids": inputs["input_ids"][:3]}, labels[:3])
    import pp_common

    gpt = apply_pp(pp_common.build("gpt", tie=False), strategy())
    with pytest.raises(TypeError, match="a dict of model keyword inputs needs a model split at its blocks"):
        gpt.train_batch({"input_ids": inputs["input_ids"] % 64}, labels % 64)


@pytest.mark.parametrize("dp,tp,schedule", [(2, 1, "1F1B"), (1, 2, "ZB-H1")])
def test_mask_ignored_labels_and_eval_with_data_or_tensor_parallel_inside_stages(dp, tp, schedule):
    """The simulated world: an attention mask in the dict of model inputs, labels with -100 (the distributed
    cross-entropy and the plain one must give one loss) and eval_batch's logits, equal to one process."""
    inputs, labels = batch(0)
    labels[0, :] = -100
    build = lambda: llama(num_hidden_layers=4, tie_word_embeddings=False)  # noqa: E731
    ref = build()
    with paddle.no_grad():
        want_logits = auto_split.model_output(ref(**inputs)).numpy()
    want = one_process(build, [(inputs, labels)], own_loss)
    with ap.simulate(world_size=2 * dp * tp):
        model = build()
        s = strategy(schedule=schedule)
        s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
        pipe, opt = ap.parallelize(model, paddle.optimizer.SGD(0.5, parameters=model.parameters()), strategy=s)
        np.testing.assert_allclose(pipe.eval_batch(inputs).numpy(), want_logits, rtol=1e-5, atol=1e-5)
        losses = [pipe.train_batch(inputs, labels)]
        opt.step()
        got = {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in pipe.named_parameters()}
    assert_equal_runs(want, (losses, got), rtol=1e-4, atol=2e-5)


def test_a_step_after_a_failed_one():
    """A loss that raises on the second micro-batch stops the step midway (the first micro-batch's input gradient
    already handed back). In one process the next step starts clean: after clear_gradients it equals a fresh
    pipeline's step. On real ranks transfers of the failed step may still be pending with the peers: the next
    step is refused instead of pairing with them."""
    calls = {"n": 0}

    def flaky(logits, labels):
        calls["n"] += 1
        if calls["n"] == 2:
            raise FloatingPointError("loss blew up")
        return F.cross_entropy(logits, labels)

    s = strategy(schedule="1F1B", micro_batches=4)
    fresh = apply_pp(KwargsModel(), s, loss_fn=flaky)
    calls["n"] = 2                                           # the fresh pipeline never raises
    want = fresh.train_batch(*batch(1))
    want_grads = {n: p.grad.numpy() for n, p in fresh.named_parameters()}
    pipe = apply_pp(KwargsModel(), s, loss_fn=flaky)
    calls["n"] = 0
    with pytest.raises(FloatingPointError):
        pipe.train_batch(*batch(0))
    pipe.clear_gradients()
    np.testing.assert_allclose(pipe.train_batch(*batch(1)), want, rtol=1e-6)
    for n, p in pipe.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), want_grads[n], rtol=1e-6, atol=1e-7, err_msg=n)
    pipe.ranks = np.arange(2).reshape(2, 1, 1)               # as on real ranks
    calls["n"] = 1
    with pytest.raises(FloatingPointError):
        pipe.train_batch(*batch(0))
    with pytest.raises(RuntimeError, match="a previous pipeline step failed on this rank \\(FloatingPointError"):
        pipe.train_batch(*batch(1))


def test_calling_the_pipeline_without_labels_in_training():
    """Called like the model in training mode without labels: under an explicit 1F1B a TypeError naming both
    remedies; under FThenB the logits (the model's dict form), whose user loss trains as one process does, the
    attention mask and keyword inputs included (test_pipeline_external_loss.py runs more losses)."""
    with ap.simulate(world_size=2):
        paddle.seed(0)
        model = KwargsModel()
        pipe, _ = ap.parallelize(model, paddle.optimizer.SGD(0.5, parameters=model.parameters()), strategy=strategy())
        inputs, _ = batch(0)
        for call in (lambda: pipe(**inputs), lambda: pipe.forward(inputs["input_ids"])):
            with pytest.raises(TypeError, match=r"schedule was set to '1F1B': call model\(x, labels=y\).*\"FThenB\""):
                call()
    batches = [batch(0), batch(1)]
    want = one_process(KwargsModel, batches, ce)
    with ap.simulate(world_size=2):
        model = KwargsModel()
        pipe, opt = ap.parallelize(model, paddle.optimizer.SGD(0.5, parameters=model.parameters()),
                                   strategy=strategy(schedule="FThenB"))
        losses = []
        for inputs, labels in batches:
            out = pipe(**inputs)
            assert isinstance(out, dict) and list(out) == ["logits"]
            loss = F.cross_entropy(out["logits"], paddle.to_tensor(labels))
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
        got = losses, {n: p.numpy() for n, p in pipe.named_parameters()}
    assert_equal_runs(want, got)
