"""PaddleFormers causal LMs through ``ap.parallelize`` with pipeline parallelism on real gloo ranks, each job a few
steps against one process (every step's loss, every evaluation loss, every rank's final parameters): tied
embeddings (Llama, Qwen3, Qwen2-MoE; on 4 pipeline ranks, where the embedding's and the head's ranks are not
neighbours), MoE families (Qwen2-MoE, Qwen3-MoE, DeepSeek-V3), an odd layer count (3, 5), every schedule (FThenB,
1F1B, VPP, ZB-H1), keyword inputs with an attention mask, packed position ids and -100 labels, evaluation between
steps (``eval_batch`` and the model called under ``paddle.no_grad()``, a batch padded to fit), gradient
accumulation (train_batch and called like the model), recompute (the strategy's and the model's own
``config.recompute``), ZeRO-1/2 with DP inside the stages, TP inside the stages. One job of the shared 2-rank
launch and one of the 4-rank launch (tests/dist_scripts/pp_models5_worker.py).

In one process (``ap.simulate``): a model that wraps each block call in paddle's reentrant ``recompute`` (the model's
own ``config.recompute`` of PaddleFormers: ``recompute(layer, hidden, ...)`` runs the layer under ``no_grad`` inside a
PyLayer) trained the first stage's blocks with zero gradients (the stage stopped inside its last block, whose raw
output has no graph), and its split's dry run put the embedding on the last stage too (refusing DP / TP inside the
stages as for a tied embedding); a recompute region spanning a stage boundary is refused by name; the refusals for
too few layers, a batch that does not fit the micro-batches, ``output_router_logits=True`` among the model inputs
(before: an AttributeError on the last stage midway through the step) and a call asking for the blocks' outputs
(before: ``out.hidden_states`` was ``None``)."""
import json
import os

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as ap
from autoparallel.parallel.pipeline import auto_split
from autoparallel.parallel.pipeline.runtime import apply_pp
from autoparallel.testing import paddleformers_models as pf
from dist_scripts import shared_launch

pytestmark = pytest.mark.skipif(not pf.available(), reason="PaddleFormers is not installed")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_scripts", "pp_models5_worker.py")
RC = {"recompute": True, "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
UNTIED = {"tie_word_embeddings": False}
FORMS = {"ignore": True, "mask": True, "pos": True}
JOBS2 = [
    dict(name="p5_qwen3_tied_fthenb", model="qwen3", layers=3, schedule="FThenB", over={"tie_word_embeddings": True},
         eval="batch", eval_b=3, **FORMS),
    dict(name="p5_qwen3moe_zb_accum", model="qwen3_moe", layers=3, schedule="ZB-H1", accum=2, opt="adamw", mask=True),
    dict(name="p5_llama_vpp_own_recompute", layers=5, schedule="VPP", vpp=2, over=RC, form="call", accum=2,
         eval="call", **FORMS),
    dict(name="p5_dsv3_1f1b_recompute", model="deepseek_v3", layers=4, recompute=True, b=6, mb=3, ignore=True),
]
JOBS4 = [
    dict(name="p5_qwen2moe_tied_tp", model="qwen2_moe", layers=3, tp=2, over={"tie_word_embeddings": True},
         eval="batch", eval_b=5, **FORMS),
    dict(name="p5_llama_dp_zero2_own_recompute", dp=2, zero=2, over=dict(RC, **UNTIED), accum=2, opt="adamw",
         b=6, mb=3, **FORMS),
    dict(name="p5_llama_pp4_tied_zb", pp=4, layers=5, mb=4, schedule="ZB-H1", eval="call", eval_b=6, ignore=True,
         mask=True),
]
JOB2 = shared_launch.job(__name__, "pp_models5", WORKER, 2, args=lambda out: [out, json.dumps(JOBS2)], timeout=300)
JOB4 = shared_launch.job(__name__, "pp_models5_4", WORKER, 4, args=lambda out: [out, json.dumps(JOBS4)],
                         timeout=300)


def one_process(job):
    """(losses, evaluation losses, {name: final parameter}) of the job's loop on the unsplit model."""
    import pp_models5_worker as w

    model = w.model_of(job)
    opt = w.optimizer(job, model.parameters())
    losses, evals, accum = [], [], job.get("accum", 1)
    for step in range(job.get("steps", 2)):
        if job.get("eval"):
            model.eval()
            inputs, labels = w.batch(job, 50 + step, job.get("eval_b"))
            with paddle.no_grad():
                evals.append(float(pf.loss_of(model(**w.as_tensors(inputs), labels=paddle.to_tensor(labels)))))
            model.train()
        for k in range(accum):
            inputs, labels = w.batch(job, step * accum + k)
            loss = pf.loss_of(model(**w.as_tensors(inputs), labels=paddle.to_tensor(labels)))
            (loss / accum if job.get("form") == "call" else loss).backward()   # train_batch calls add up
            losses.append(float(loss))
        opt.step()
        opt.clear_grad()
    return losses, evals, {n: p.numpy() for n, p in model.named_parameters()}


def _check(launch_job, job):
    out, ranks = shared_launch.results(launch_job)
    losses, evals, params = one_process(job)
    seen = set()
    for r in ranks:
        got = r["jobs"][job["name"]]
        assert "error" not in got, got.get("error")
        np.testing.assert_allclose(got["losses"], losses, rtol=1e-5, err_msg=f"rank {r['rank']}")
        np.testing.assert_allclose(got["evals"], evals, rtol=1e-5, err_msg=f"rank {r['rank']}")
        saved = np.load(os.path.join(out, f"{job['name']}.rank{r['rank']}.npz"))
        for n in saved.files:
            np.testing.assert_allclose(saved[n], params[n], rtol=1e-4, atol=2e-5, err_msg=f"rank {r['rank']}: {n}")
            seen.add(n)
    assert seen == set(params)
    assert {r["jobs"][job["name"]]["pp_rank"] for r in ranks} == set(range(job.get("pp", 2)))


@pytest.mark.parametrize("job", JOBS2, ids=[j["name"] for j in JOBS2])
def test_two_ranks_equal_one_process(job):
    _check(JOB2, job)


@pytest.mark.parametrize("job", JOBS4, ids=[j["name"] for j in JOBS4])
def test_four_ranks_equal_one_process(job):
    _check(JOB4, job)


# ---- in one process ------------------------------------------------------------------------------------------------
class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h):
        return h + paddle.tanh(self.fc(h))


class SegmentRecompute(nn.Layer):
    """Blocks called in segments of ``seg`` inside paddle's reentrant recompute while the hidden state needs a
    gradient (PaddleFormers' ``config.recompute`` with ``seg=1``)."""

    def __init__(self, seg):
        super().__init__()
        self.emb, self.out = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.layers = nn.LayerList([Block() for _ in range(4)])
        self.seg = seg

    def forward(self, ids):
        from paddle.distributed.fleet.utils import recompute

        h = self.emb(ids)
        for i in range(0, len(self.layers), self.seg):
            def run(x, i=i):
                for b in self.layers[i:i + self.seg]:
                    x = b(x)
                return x
            h = run(h) if h.stop_gradient else recompute(run, h)
        return self.out(h)


def _toy_batch():
    rng = np.random.default_rng(0)
    return paddle.to_tensor(rng.integers(0, 32, (4, 6))), paddle.to_tensor(rng.integers(0, 32, (4, 6)))


@pytest.mark.parametrize("seg", [1, 2])
def test_blocks_in_the_models_own_recompute_get_their_gradients(seg):
    """Before: the first stage stopped inside its last block's call, inside the recompute's no-grad forward, and
    handed on an activation without a graph: the first stage's blocks got zero gradients."""
    ids, y = _toy_batch()
    paddle.seed(0)
    ref = SegmentRecompute(seg)
    F.cross_entropy(ref(ids), y).backward()
    paddle.seed(0)
    model = SegmentRecompute(seg)
    s = ap.Strategy()
    s.pipeline_parallel.degree = 2
    apply_pp(model, s).train_batch(ids, y)
    want = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), want[n].grad.numpy(), rtol=1e-5, atol=1e-7, err_msg=n)
    assert float(model.layers[0].fc.weight.grad.abs().sum()) > 0


def test_recompute_region_across_a_stage_boundary_is_refused():
    ids, y = _toy_batch()
    s = ap.Strategy()
    s.pipeline_parallel.degree = 2
    pipe = apply_pp(SegmentRecompute(4), s)
    with pytest.raises(NotImplementedError, match=r"blocks #1 and #2 in one no-grad region"):
        pipe.train_batch(ids, y)


def _llama_own_recompute(**over):
    return pf.build("llama", num_hidden_layers=4, **dict(RC, **over))


def test_paddleformers_own_recompute_trains_every_stage():
    """PaddleFormers Llama with ``config.recompute`` (per-layer reentrant recompute), PP2 1F1B in one process: two
    SGD steps equal to one process (before: the second loss differed, the first stage's blocks never moved)."""
    def batch(i):
        x, y = pf.batch(i, b=4, t=8)
        return paddle.to_tensor(x), paddle.to_tensor(y)

    ref = _llama_own_recompute()
    opt = paddle.optimizer.SGD(0.5, parameters=ref.parameters())
    want = []
    for i in range(2):
        loss = pf.loss_of(ref(input_ids=batch(i)[0], labels=batch(i)[1]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        want.append(float(loss))
    model = _llama_own_recompute()
    s = ap.Strategy()
    s.pipeline_parallel.degree = 2
    got = []
    with ap.simulate(world_size=2):
        pipe, opt = ap.parallelize(model, paddle.optimizer.SGD(0.5, parameters=model.parameters()), strategy=s)
        for i in range(2):
            got.append(float(pipe.train_batch(*batch(i))))
            opt.step()
            opt.clear_grad()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        np.testing.assert_allclose(p.numpy(), params[n].numpy(), rtol=1e-4, atol=2e-5, err_msg=n)


def test_model_recompute_does_not_tie_the_embedding_to_the_last_stage():
    """The split's dry run fed the last block's output at the first block, so every later block ran inside the
    model's recompute wrapper, which tied the output to the embedding: an untied Llama's embedding went to the
    last stage too, and DP / TP inside the stages were refused as for a tied embedding."""
    model = _llama_own_recompute(**UNTIED)
    pre, post, _ = auto_split.piece_params(model, "model.layers", paddle.to_tensor([[1, 2]]))
    assert "model.embed_tokens.weight" in pre and "model.embed_tokens.weight" not in post
    assert "lm_head.weight" in post and "model.norm.weight" in post
    tied = _llama_own_recompute(tie_word_embeddings=True)
    pre, post, _ = auto_split.piece_params(tied, "model.layers", paddle.to_tensor([[1, 2]]))
    assert "model.embed_tokens.weight" in pre and "model.embed_tokens.weight" in post


def _strategy(**kw):
    s = ap.Strategy()
    s.pipeline_parallel.degree = 2
    for k, v in kw.items():
        setattr(s.pipeline_parallel, k, v)
    return s


def test_fewer_layers_than_stages_is_refused():
    model = pf.build("llama", num_hidden_layers=1)
    with ap.simulate(world_size=2), pytest.raises(ValueError, match="exceed the model's layers=1"):
        ap.parallelize(model, paddle.optimizer.SGD(0.1, parameters=model.parameters()), strategy=_strategy())
    model = pf.build("llama", num_hidden_layers=3)
    with ap.simulate(world_size=2), pytest.raises(ValueError, match=r"= 4 stages exceed the model's layers=3"):
        ap.parallelize(model, paddle.optimizer.SGD(0.1, parameters=model.parameters()),
                       strategy=_strategy(schedule="VPP", vpp_degree=2))


def test_a_batch_that_does_not_fit_the_micro_batches_is_refused():
    model = pf.build("llama", num_hidden_layers=3)
    x, y = pf.batch(0, b=5, t=8)
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(model, paddle.optimizer.SGD(0.1, parameters=model.parameters()),
                                 strategy=_strategy())
        with pytest.raises(ValueError, match=r"global batch \(5 samples\) must divide into micro_batches"):
            pipe.train_batch({"input_ids": paddle.to_tensor(x)}, paddle.to_tensor(y))
        assert all(p.grad is None for p in pipe.parameters())


def test_router_loss_flag_among_the_inputs_is_refused_before_any_transfer():
    """``output_router_logits=True`` as a model input (the config flag is refused when the pipeline is built): the
    model would add its router's loss to its own loss, which the pipeline does not compute. Before: an
    ``AttributeError`` ('int' object has no attribute 'shape') on the last stage, after the first stage's forward
    and its transfer."""
    import pp_models5_worker as w

    job = {"model": "qwen2_moe", "layers": 2}
    inputs, labels = w.batch(job, 0)
    model = w.model_of(job)
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(model, paddle.optimizer.SGD(0.1, parameters=model.parameters()),
                                 strategy=_strategy())
        flagged = dict(w.as_tensors(inputs), output_router_logits=True)
        for run in (lambda: pipe.train_batch(flagged, paddle.to_tensor(labels)),
                    lambda: pipe(**flagged, labels=paddle.to_tensor(labels)),
                    lambda: pipe.eval_batch([dict(flagged)] * 2)):
            with pytest.raises(NotImplementedError, match="output_router_logits=True: the model would add"):
                run()
            assert pipe.records == []                     # no action of the schedule ran
        assert all(p.grad is None for p in pipe.parameters())
        loss = pipe.train_batch(dict(w.as_tensors(inputs), output_router_logits=False), paddle.to_tensor(labels))
    ref = w.model_of(job)
    want = pf.loss_of(ref(**w.as_tensors(inputs), labels=paddle.to_tensor(labels)))
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)


@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_call_asking_for_outputs_of_the_blocks_is_refused(flag, mode):
    """Before: the call's output form was learned without the flag, so ``out.hidden_states`` came back ``None`` (as if
    the model had not been asked), and a training call without labels handed the last stage's pass-through values
    of the skipped blocks."""
    x, y = pf.batch(0, b=4, t=8)
    model = pf.build("llama", num_hidden_layers=2)
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(model, paddle.optimizer.SGD(0.1, parameters=model.parameters()),
                                 strategy=_strategy())
        getattr(pipe, mode)()
        for labels in ({"labels": paddle.to_tensor(y)}, {}):
            with pytest.raises(NotImplementedError, match=f"{flag}=True: a pipeline-parallel model's call returns"):
                pipe(input_ids=paddle.to_tensor(x), return_dict=True, **{flag: True}, **labels)
        out = pipe(input_ids=paddle.to_tensor(x), return_dict=True, labels=paddle.to_tensor(y), **{flag: False})
        assert np.isfinite(float(out.loss))
