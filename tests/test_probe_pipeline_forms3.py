"""What users write around a pipeline-parallel PaddleFormers model, in the simulated world, against one process:
``paddle.jit.to_static`` over a step that calls the pipeline (or over the pipeline itself) runs in dygraph mode with
a one-line notice; a collator's dict holding the labels (``train_batch(batch)``, ``eval_batch(batch)``);
``model(..., return_dict=True).logits`` of a training call without labels; position ids of shape ``[1, seq]``
broadcast over the batch; the model's methods a pipeline does not run (``generate``, ``state_dict``) named."""
import warnings

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.dist_tensor import _local_from_full
from autoparallel.graph import jit
from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="PaddleFormers is not installed")

LR, SEQ = 0.5, 8


def build():
    return pf.build("qwen2", num_hidden_layers=4)


def batches(n=2):
    """(ids, labels with -100, attention mask) numpy triples."""
    out = []
    for i in range(n):
        x, y = pf.batch(i, b=4, t=SEQ)
        y[0, :3], y[-1, 5:] = -100, -100
        mask = np.ones_like(x)
        mask[1, 6:] = 0
        out.append((x, y, mask))
    return out


def strategy(dp=1, tp=1, schedule="1F1B"):
    s = ap.Strategy()
    s.pipeline_parallel.degree, s.pipeline_parallel.schedule, s.pipeline_parallel.micro_batches = 2, schedule, 2
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    return s


def positions():
    return paddle.arange(SEQ, dtype="int64").unsqueeze(0) + 1        # [1, seq]: broadcast over the batch


def run(step, world=None, dp=1, tp=1, schedule="1F1B"):
    """(losses, parameters or pipe) of ``step(model, opt, (ids, labels, mask))`` over two batches: one process when
    ``world`` is None, else a pipeline built by ``ap.parallelize`` inside ``ap.simulate(world)``."""
    model = build()
    opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
    if world is None:
        losses = [step(model, opt, b) for b in batches()]
        return losses, {n: p.numpy() for n, p in model.named_parameters()}
    with ap.simulate(world_size=world):
        pipe, opt = ap.parallelize(model, opt, strategy=strategy(dp, tp, schedule))
        return [step(pipe, opt, b) for b in batches()], pipe


def assert_equal(want, got, rtol=1e-4, atol=2e-5):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    bad = []
    for name, p in got[1].named_parameters():
        ref = paddle.to_tensor(want[1][name])
        shards = p.locals.items() if hasattr(p, "_ap_spec") else [(None, p)]
        for r, t in shards:
            w = _local_from_full(ref, p.spec, r) if r is not None else ref
            if not np.allclose(t.numpy(), w.numpy(), rtol=rtol, atol=atol):
                bad.append(f"{name}@{r}")
    assert not bad, bad


def own_loss(model, opt, b, **extra):
    x, y, mask = b
    out = model(input_ids=paddle.to_tensor(x), attention_mask=paddle.to_tensor(mask), labels=paddle.to_tensor(y),
                return_dict=True, **extra)
    out.loss.backward()
    opt.step()
    opt.clear_grad()
    return float(out.loss)


_REF = {}


def reference(key, step):
    if key not in _REF:
        _REF[key] = run(step)
    return _REF[key]


# ---- paddle.jit.to_static over a pipeline ----------------------------------------------------------------------
def eager_step(model, opt, b):
    x, y, _ = b
    loss = pf.loss_of(model(input_ids=paddle.to_tensor(x), labels=paddle.to_tensor(y)))
    loss.backward()
    opt.step()
    opt.clear_grad()
    return float(loss)


def jit_step(model, opt, b, _cache={}):
    key = id(model)
    if key not in _cache:
        _cache.clear()

        @paddle.jit.to_static
        def step(ids, labels):
            return pf.loss_of(model(input_ids=ids, labels=labels))
        _cache[key] = step
    x, y, _ = b
    loss = _cache[key](paddle.to_tensor(x), paddle.to_tensor(y))
    loss.backward()
    opt.step()
    opt.clear_grad()
    return float(loss)


@pytest.mark.parametrize("world,dp", [(2, 1), (4, 2)])
def test_a_jit_step_calling_the_pipeline_runs_dygraph_with_a_notice(world, dp, monkeypatch):
    """Before: paddle translated the pipeline's own Python (SOT: ``InnerError ... has no attribute micro_batches``;
    ``full_graph=True``: ``ImportError: attempted relative import``)."""
    monkeypatch.setattr(jit, "_NOTICED", set())                # the notice comes once per function and process
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = run(jit_step, world, dp=dp)
    assert_equal(reference("plain", eager_step), got)
    notes = [str(w.message) for w in seen if "paddle.jit.to_static" in str(w.message)]
    assert len(notes) == 1 and "pipeline-parallel model" in notes[0] and "dygraph mode" in notes[0], notes


def test_jit_to_static_of_the_pipeline_itself():
    """Before: ``AttributeError: 'PipelineModule' object has no attribute '__name__'`` inside paddle."""
    def step(model, opt, b):
        x, y, _ = b
        loss = pf.loss_of(paddle.jit.to_static(model)(input_ids=paddle.to_tensor(x), labels=paddle.to_tensor(y)))
        loss.backward()
        opt.step()
        opt.clear_grad()
        return float(loss)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_equal(reference("plain", eager_step), run(step, 2))


# ---- a collator's dict holding the labels ------------------------------------------------------------------------
def dict_with_labels(model, opt, b):
    x, y, mask = b
    batch = {"input_ids": paddle.to_tensor(x), "attention_mask": paddle.to_tensor(mask), "labels": paddle.to_tensor(y)}
    loss = model.train_batch(batch) if hasattr(model, "train_batch") else own_loss(model, opt, b)
    if hasattr(model, "train_batch"):
        opt.step()
        opt.clear_grad()
    return float(loss)


def test_labels_inside_the_inputs_dict_train_and_evaluate():
    """Before: ``ValueError: ... train_batch needs the labels; got None`` (train_batch) and paddle's concat
    ``ValueError`` (eval_batch: the model's loss read as its logits)."""
    want = reference("own", own_loss)
    got = run(dict_with_labels, 4, dp=2)
    assert_equal(want, got)
    x, y, mask = batches()[0]
    one = build()
    one.eval()
    ref = float(one(input_ids=paddle.to_tensor(x), attention_mask=paddle.to_tensor(mask), labels=paddle.to_tensor(y),
                    return_dict=True).loss)
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(build(), None, strategy=strategy())
        pipe.eval()
        batch = {"input_ids": x, "attention_mask": mask, "labels": y}
        np.testing.assert_allclose(float(pipe.eval_batch(batch)), ref, rtol=1e-5)
        with pytest.raises(ValueError, match="labels were given twice"):
            pipe.train_batch(batch, y)


# ---- return_dict of a training call without labels ---------------------------------------------------------------
def shifted(model, opt, b, return_dict=True):
    x, y, mask = b
    out = model(input_ids=paddle.to_tensor(x), attention_mask=paddle.to_tensor(mask), return_dict=return_dict)
    logits = out.logits if return_dict else out[0]
    loss = F.cross_entropy(logits[:, :-1], paddle.to_tensor(y)[:, 1:], ignore_index=-100)
    loss.backward()
    opt.step()
    opt.clear_grad()
    return float(loss)


def test_return_dict_of_a_training_call_without_labels():
    """Before: the call ignored ``return_dict=True`` and returned the model's default tuple (``AttributeError:
    'tuple' object has no attribute 'logits'``)."""
    got = run(shifted, 4, dp=2, schedule="FThenB")
    assert_equal(reference("shifted", shifted), got)
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(build(), None, strategy=strategy(schedule="FThenB"))
        x = paddle.to_tensor(batches()[0][0])
        assert type(pipe(x, return_dict=True)).__name__ == "CausalLMOutputWithPast"
        assert isinstance(pipe(x, return_dict=False), tuple)


# ---- position ids broadcast over the batch ---------------------------------------------------------------------
def with_positions(model, opt, b):
    x, y, _ = b
    if hasattr(model, "train_batch") and model.schedule == "ZB-H1":
        loss = model.train_batch({"input_ids": x, "position_ids": positions()}, y)
        opt.step()
        opt.clear_grad()
        return float(loss)
    out = model(input_ids=paddle.to_tensor(x), position_ids=positions(), labels=paddle.to_tensor(y), return_dict=True)
    out.loss.backward()
    opt.step()
    opt.clear_grad()
    return float(out.loss)


@pytest.mark.parametrize("world,dp,tp,schedule", [(2, 1, 1, "ZB-H1"), (4, 2, 1, "1F1B"), (4, 1, 2, "1F1B")])
def test_position_ids_of_one_row_broadcast_over_the_batch(world, dp, tp, schedule):
    """Before: ``ValueError: train_batch inputs['position_ids']: the global batch (1 samples) must divide into
    micro_batches x data-parallel degree``."""
    assert_equal(reference("positions", with_positions), run(with_positions, world, dp=dp, tp=tp, schedule=schedule))


def test_broadcast_positions_in_a_padded_evaluation_batch():
    x, y, _ = batches()[0]
    x, y = x[:3], y[:3]
    one = build()
    one.eval()
    want = one(input_ids=paddle.to_tensor(x), position_ids=positions(), labels=paddle.to_tensor(y))
    with ap.simulate(world_size=4):
        pipe, _ = ap.parallelize(build(), None, strategy=strategy(dp=2))
        pipe.eval()
        loss = pipe.eval_batch({"input_ids": x, "position_ids": positions()}, y)
        logits = pipe.eval_batch({"input_ids": x, "position_ids": positions()})
    np.testing.assert_allclose(loss, float(want[0]), rtol=1e-5)
    full = logits.full() if hasattr(logits, "full") else logits
    np.testing.assert_allclose(full.numpy(), want[1].numpy(), rtol=1e-4, atol=1e-5)


# ---- the model's methods a pipeline does not run -------------------------------------------------------------------
def test_model_methods_the_pipeline_does_not_run_are_named():
    """Before: a bare ``AttributeError: 'PipelineModule' object has no attribute 'generate'``."""
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(build(), None, strategy=strategy())
    with pytest.raises(AttributeError, match=r"Qwen2ForCausalLMDeprecated\.generate does not run across them; to "
                                             r"generate, load the trained parameters into an unsplit"):
        pipe.generate(paddle.to_tensor(batches()[0][0]), max_new_tokens=2)
    with pytest.raises(AttributeError, match=r"for a checkpoint use ap\.training_state\(pipe, opt\)"):
        pipe.state_dict()
    assert not hasattr(pipe, "generate")
    with pytest.raises(AttributeError, match=r"^'PipelineModule' object has no attribute 'no_such_thing'$"):
        pipe.no_such_thing


# ---- backward after model.eval() -----------------------------------------------------------------------------------
def test_backward_after_eval_mode_raises_instead_of_training_nothing():
    """One process trains in eval mode (dropout off). Before: the pipeline's eval-mode call ran forward only and
    ``loss.backward(); opt.step()`` silently changed nothing (the next loss 5.677 against one process's 5.857)."""
    x, y, _ = batches()[0]
    with ap.simulate(world_size=2):
        model = build()
        pipe, opt = ap.parallelize(model, paddle.optimizer.SGD(LR, parameters=model.parameters()), strategy=strategy())
        pipe.eval()
        loss = pipe(input_ids=paddle.to_tensor(x), labels=paddle.to_tensor(y), return_dict=True).loss
        with pytest.raises((OSError, RuntimeError), match="called after model.eval\\(\\): that call ran forward only"):
            loss.backward()
        logits = pipe(input_ids=paddle.to_tensor(x), return_dict=True).logits
        with pytest.raises((OSError, RuntimeError), match=r"model.train_batch\(inputs, labels\), which trains in"):
            F.cross_entropy(logits, paddle.to_tensor(y), ignore_index=-100).backward()
        assert all(p.grad is None for p in pipe.parameters())
        with paddle.no_grad():                         # the evaluation loop: values, nothing refused
            value = float(pipe(input_ids=paddle.to_tensor(x), labels=paddle.to_tensor(y), return_dict=True).loss)
    one = build()
    one.eval()
    want = one(input_ids=paddle.to_tensor(x), labels=paddle.to_tensor(y), return_dict=True).loss
    np.testing.assert_allclose(value, float(want), rtol=1e-5)


# ---- model = paddle.jit.to_static(model), then split into stages ----------------------------------------------------
class _Block(paddle.nn.Layer):
    def __init__(self, d):
        super().__init__()
        self.fc = paddle.nn.Linear(d, d)

    def forward(self, h):
        return h + paddle.tanh(self.fc(h))


class _Net(paddle.nn.Layer):
    def __init__(self, d=16, n=4):
        super().__init__()
        paddle.seed(0)
        self.emb, self.head = paddle.nn.Embedding(64, d), paddle.nn.Linear(d, 64)
        self.layers = paddle.nn.LayerList([_Block(d) for _ in range(n)])

    def forward(self, input_ids):
        h = self.emb(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _net_run(world, full_graph, blocks=False):
    rng = np.random.default_rng(0)
    model = _Net()
    if world is not None:
        for b in model.layers if blocks else []:
            paddle.jit.to_static(b, full_graph=full_graph)
        model = paddle.jit.to_static(model, full_graph=full_graph)
    opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
    data = [(rng.integers(0, 64, (4, 8)), rng.integers(0, 64, (4, 8))) for _ in range(2)]
    if world is None:
        losses = []
        for x, y in data:
            loss = F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y))
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
        return losses, {n: p.numpy() for n, p in model.named_parameters()}
    with ap.simulate(world_size=world):
        pipe, opt = ap.parallelize(model, opt, strategy=strategy(dp=world // 2))
        losses = []
        for x, y in data:
            losses.append(float(pipe.train_batch(x, y)))
            opt.step()
            opt.clear_grad()
        return losses, pipe


@pytest.mark.parametrize("world,full_graph,blocks", [(2, False, False), (2, True, True), (4, False, True)])
def test_a_model_given_to_jit_to_static_then_split_runs_dygraph_with_a_notice(world, full_graph, blocks):
    """One process runs ``paddle.jit.to_static(model)``. Before: ``ValueError: no signature found for builtin
    SymbolicStaticFunction`` (bytecode translator) / ``too many values to unpack`` (AST) at the split."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _net_run(world, full_graph, blocks)
    assert_equal(_net_run(None, full_graph), got)
    notes = [str(w.message) for w in seen if str(w.message).startswith("paddle.jit.to_static(")]
    assert len(notes) == 1 and "runs these forwards in dygraph mode" in notes[0], notes
    assert ("layers.0" in notes[0]) == blocks and "_Net" in notes[0]
