"""``loss_fn(model(x), y)`` on a pipeline-parallel model (parallel/pipeline/external_loss.py), in the simulated
world: the user's own loss code on the logits a training call returns, then ``loss.backward()``, equals one process
(every step's loss, every rank's shard of every parameter after AdamW steps) for a class of losses: mean
cross-entropy, ``ignore_index`` with ignored labels, ``reduction="sum"``, a shifted-slice LM loss, an added z-loss
term, ``loss * 0.5`` accumulated over two calls, a ``paddle.nn.CrossEntropyLoss()`` criterion; on the example GPT and
a PaddleFormers Llama under PP2, DP2 x PP2 and TP2 x PP2. A schedule left at its default runs FThenB (every forward
before any backward, in ``pipe.records``); an explicit 1F1B raises; a wrong gradient split (one micro-batch's
gradient dropped) makes the same comparison fail."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import pp_common

import autoparallel as ap
from autoparallel.dist_tensor import _local_from_full
from autoparallel.parallel.pipeline import external_loss
from autoparallel.testing import paddleformers_models as pf
from test_pipeline_called import mismatches  # noqa: E402  (same tolerances)

RTOL, ATOL, LR = 1e-4, 2e-5, 3e-3        # parameters after AdamW (see test_pipeline_called.py); losses: rtol 1e-5


def strategy(dp=1, tp=1, schedule=None):
    s = ap.Strategy()
    s.pipeline_parallel.degree, s.pipeline_parallel.micro_batches = 2, 4
    if schedule is not None:
        s.pipeline_parallel.schedule = schedule
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    return s


def logits_of(out):
    """The logits of a model's output: a tensor, a tuple ``(logits,)`` or an output object."""
    if isinstance(out, (tuple, list)):
        return out[0]
    return out if not hasattr(out, "logits") else out.logits


# ---- the losses: the user's code, the same in one process and on the pipeline ----------------------------------
def ce_mean(logits, y):
    return F.cross_entropy(logits, y).mean()


def ce_ignore(logits, y):
    return F.cross_entropy(logits, y, ignore_index=-100)


def ce_sum(logits, y):
    return F.cross_entropy(logits, y, reduction="sum")


def shifted(logits, y):
    return F.cross_entropy(logits[:, :-1], y[:, 1:]).mean()


def z_loss(logits, y):
    return F.cross_entropy(logits, y).mean() + 1e-2 * (paddle.logsumexp(logits, axis=-1) ** 2).mean()


def criterion(logits, y):
    return paddle.nn.CrossEntropyLoss()(logits, y)


def ignored(y):
    """Labels with every third one ignored (-100)."""
    y = y.copy()
    y.reshape(-1)[::3] = -100
    return y


def loop(model, opt, batches, loss_fn, accum=1, scale=1.0):
    """The one-process loop: ``loss_fn(model(x), y) * scale``, backward, a step every ``accum`` calls."""
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = loss_fn(logits_of(model(paddle.to_tensor(x))), paddle.to_tensor(y))
        (loss * scale if scale != 1.0 else loss).backward()
        losses.append(float(loss))
        if (i + 1) % accum == 0:
            opt.step()
            opt.clear_grad()
    return losses


def make_opt(params, kind):
    """AdamW, or SGD where AdamW turns float noise into visible differences: AdamW divides by the root of the second
    moment, so an element whose gradient is near zero in theory (the key bias of attention, a z-loss's cancelling
    terms, some Llama weights) moves by a good part of a step on float sums in another order (1.5e-4 after three
    steps of 3e-3 measured with the z-loss; see test_pipeline_called.py). SGD keeps those comparisons tight."""
    if kind == "sgd":
        return paddle.optimizer.SGD(0.1, parameters=params)
    if kind == "sgd-sum":                              # a summed loss: gradients 128 times a mean's
        return paddle.optimizer.SGD(1e-3, parameters=params)
    return paddle.optimizer.AdamW(LR, parameters=params)


OPT = {"ce_sum": "sgd-sum", "z_loss": "sgd"}


def compare(build, batches, loss_fn, s, tp_plan=None, accum=1, scale=1.0, opt=None):
    """(one-process losses, pipeline losses, mismatching parameter shards, pipe)."""
    opt = opt or OPT.get(loss_fn.__name__, "adamw")
    ref = build()
    ref_losses = loop(ref, make_opt(ref.parameters(), opt), batches, loss_fn, accum, scale)
    ref_params = {n: p.numpy() for n, p in ref.named_parameters()}
    world = s.pipeline_parallel.degree * (s.data_parallel.degree or 1) * s.tensor_parallel.degree
    with ap.simulate(world_size=world):
        m = build()
        pipe, opt = ap.parallelize(m, make_opt(m.parameters(), opt), strategy=s, tp_plan=tp_plan)
        losses = loop(pipe, opt, batches, loss_fn, accum, scale)
        bad = mismatches(pipe, ref_params)
    return ref_losses, losses, bad, pipe


def gpt():
    return pp_common.build("gpt")


GPT_BATCHES = pp_common.batches(3)


def gpt_tp_plan(tp):
    from autoparallel.testing.models import tp_plan

    return tp_plan("gpt") if tp > 1 else None


LOSSES = [ce_mean, ce_ignore, ce_sum, shifted, z_loss, criterion]


@pytest.mark.parametrize("loss_fn", LOSSES, ids=lambda f: f.__name__)
def test_gpt_losses_pp2_equal_one_process(loss_fn):
    batches = [(x, ignored(y)) for x, y in GPT_BATCHES] if loss_fn is ce_ignore else GPT_BATCHES
    ref_losses, losses, bad, _ = compare(gpt, batches, loss_fn, strategy())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert bad == []


@pytest.mark.parametrize("dp,tp,loss_fn", [(2, 1, ce_mean), (2, 1, shifted), (2, 1, ce_ignore), (1, 2, ce_mean),
                                           (1, 2, z_loss)], ids=lambda v: getattr(v, "__name__", str(v)))
def test_gpt_losses_with_dp_or_tp_equal_one_process(dp, tp, loss_fn):
    batches = [(x, ignored(y)) for x, y in GPT_BATCHES] if loss_fn is ce_ignore else GPT_BATCHES
    ref_losses, losses, bad, _ = compare(gpt, batches, loss_fn, strategy(dp, tp), tp_plan=gpt_tp_plan(tp))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert bad == []


@pytest.mark.parametrize("dp", [1, 2])
def test_half_loss_accumulated_over_two_calls_equals_one_process(dp):
    ref_losses, losses, bad, _ = compare(gpt, pp_common.batches(4), ce_mean, strategy(dp), accum=2, scale=0.5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert bad == []


# ---- PaddleFormers Llama ---------------------------------------------------------------------------------------
def llama():
    return pf.build("llama", tie_word_embeddings=False, num_hidden_layers=4)


LLAMA_BATCHES = [pf.batch(i, b=8, t=8) for i in range(3)]


@pytest.mark.skipif(not pf.available(), reason="PaddleFormers is not installed")
@pytest.mark.parametrize("dp,tp,loss_fn,opt", [(1, 1, ce_mean, "adamw"), (1, 1, shifted, "adamw"),
                                               (2, 1, ce_mean, "adamw"), (2, 1, z_loss, "sgd"),
                                               (1, 2, ce_mean, "sgd")], ids=lambda v: getattr(v, "__name__", str(v)))
def test_llama_losses_equal_one_process(dp, tp, loss_fn, opt):
    ref_losses, losses, bad, _ = compare(llama, LLAMA_BATCHES, loss_fn, strategy(dp, tp), opt=opt)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert bad == []


# ---- schedules -------------------------------------------------------------------------------------------------
def test_default_schedule_runs_fthenb_and_explicit_fthenb_runs():
    """The strategy's schedule left at its default (1F1B for train_batch): this form runs FThenB, every forward of
    a rank before any of its backwards; an explicit FThenB gives the same losses."""
    ref_losses, losses, bad, pipe = compare(gpt, GPT_BATCHES[:2], ce_mean, strategy())
    assert pipe.plan.schedule.name == "1F1B" and not pipe.schedule_chosen
    assert "pp=2 (1F1B; FThenB for loss_fn(model(x), y), 4 micro-batches)" in str(strategy())
    assert "pp=2 (1F1B, 4 micro-batches)" in str(strategy(schedule="1F1B"))
    for rank in range(2):
        kinds = [r.kind for r in pipe.records if r.rank == rank and r.kind in ("F", "B")]
        assert kinds == ["F"] * 4 + ["B"] * 4, kinds
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert bad == []
    ref_losses, losses, bad, _ = compare(gpt, GPT_BATCHES[:2], ce_mean, strategy(schedule="FThenB"))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert bad == []


@pytest.mark.parametrize("schedule", ["1F1B", "ZB-H1", "VPP"])
def test_explicit_other_schedule_refused(schedule):
    x, _ = (paddle.to_tensor(v) for v in GPT_BATCHES[0])
    s = strategy(schedule=schedule)
    if schedule == "VPP":
        s.pipeline_parallel.vpp_degree = 2
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(gpt(), None, strategy=s)
        with pytest.raises(TypeError) as e:
            pipe(x)
    assert str(e.value) == (
        f"loss_fn(model(x), y) on a pipeline-parallel model runs every micro-batch's forward before any backward "
        f"(the FThenB order and memory), but strategy.pipeline_parallel.schedule was set to '{schedule}': call "
        f"model(x, labels=y) (or model.train_batch(x, y)) to train with the {schedule} schedule and the pipeline's "
        f"loss_fn, or set strategy.pipeline_parallel.schedule = \"FThenB\" for loss_fn(model(x), y)")


def test_labels_form_keeps_the_strategy_schedule():
    x, y = (paddle.to_tensor(v) for v in GPT_BATCHES[0])
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(gpt(), None, strategy=strategy())
        pipe(x, labels=y).backward()
        kinds = [r.kind for r in pipe.records if r.rank == 0 and r.kind in ("F", "B")]
    assert kinds != ["F"] * 4 + ["B"] * 4 and sorted(kinds) == ["B"] * 4 + ["F"] * 4


def test_batch_not_dividing_into_micro_batches_is_refused_naming_the_call():
    """6 samples on 4 micro-batches x dp 2: a ValueError naming ``model(x)`` (not train_batch), the sizes and the
    remedies, before any forward."""
    x, _ = (paddle.to_tensor(v[:6]) for v in GPT_BATCHES[0])
    with ap.simulate(world_size=4):
        pipe, _ = ap.parallelize(gpt(), None, strategy=strategy(dp=2))
        with pytest.raises(ValueError) as e:
            pipe(x)
        assert not [r for r in pipe.records if r.kind == "F"]
    assert str(e.value).startswith("model(x) inputs: the global batch (6 samples) must divide into micro_batches x "
                                   "data-parallel degree = 4 x 2 equal parts (a batch of a multiple of 8 samples")


# ---- pending calls, a GradScaler ------------------------------------------------------------------------------
def test_two_pending_calls_then_one_backward_equal_one_process():
    """``l1, l2`` from two calls, ``((l1 + l2) / 2).backward()``: the gradients one process gets (PP2 x DP2)."""
    def body(m):
        (x1, y1), (x2, y2) = ([paddle.to_tensor(v) for v in b] for b in GPT_BATCHES[:2])
        l1, l2 = ce_mean(logits_of(m(x1)), y1), shifted(logits_of(m(x2)), y2)
        ((l1 + l2) / 2).backward()

    ref = gpt()
    body(ref)
    want = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    with ap.simulate(world_size=4):
        pipe, opt = ap.parallelize(gpt(), None, strategy=strategy(dp=2))
        body(pipe)
        opt = pipe.wrap_optimizer(paddle.optimizer.SGD(0.0, parameters=pipe.parameters()))
        opt.step()                                           # reduces the data-parallel partial gradients
        got = {n: p for n, p in pipe.named_parameters()}
        assert set(got) == set(want)
        for n, p in got.items():
            for r, t in p.locals.items():
                w = _local_from_full(paddle.to_tensor(want[n]), p.spec, r).numpy()
                np.testing.assert_allclose(t.grad.numpy(), w, rtol=1e-4, atol=1e-6, err_msg=f"{n}@rank{r}")


def test_grad_scaler_equals_one_process():
    """``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` (GradScaler 1024, PP2 x DP2, SGD)."""
    from autoparallel.testing.gpu_scaler import gpu_grad_scaler

    def run(model, opt):
        scaler, losses = gpu_grad_scaler(init_loss_scaling=1024), []
        for x, y in GPT_BATCHES:
            loss = ce_mean(logits_of(model(paddle.to_tensor(x))), paddle.to_tensor(y))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.clear_grad()
            losses.append(float(loss))
        return losses

    ref = gpt()
    ref_losses = run(ref, make_opt(ref.parameters(), "sgd"))
    ref_params = {n: p.numpy() for n, p in ref.named_parameters()}
    with ap.simulate(world_size=4):
        m = gpt()
        pipe, opt = ap.parallelize(m, make_opt(m.parameters(), "sgd"), strategy=strategy(dp=2))
        losses = run(pipe, opt)
        bad = mismatches(pipe, ref_params)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert bad == []


# ---- refusals and controls -------------------------------------------------------------------------------------
def test_retain_graph_strategy_amp_and_low_precision_refused():
    x, y = (paddle.to_tensor(v) for v in GPT_BATCHES[0])
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(gpt(), None, strategy=strategy())
        loss = ce_mean(pipe(x), y)
        with pytest.raises(NotImplementedError, match=r"retain_graph=True\) through the logits"):
            loss.backward(retain_graph=True)
        assert all(p.grad is None for p in pipe.parameters())
    s = strategy()
    s.amp.enable, s.amp.dtype = True, "float16"
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(gpt(), None, strategy=s)
        with pytest.raises(NotImplementedError, match="under strategy.amp"):
            pipe(x)
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(gpt(), None, strategy=strategy())
        pipe.stages[0].add_parameter("lowp", paddle.create_parameter([2], dtype="float16"))
        with pytest.raises(NotImplementedError, match="with float16 parameters: keep fp32 parameters"):
            pipe(x)


def test_negative_control_dropped_micro_batch_gradient(monkeypatch):
    """One micro-batch's gradient zeroed before the pipeline's backward: the same comparison fails."""
    cut = external_loss.micro_grads

    def drop_first(g, m):
        parts = cut(g, m)
        return [paddle.zeros_like(parts[0])] + list(parts[1:])

    monkeypatch.setattr(external_loss, "micro_grads", drop_first)
    ref_losses, losses, bad, _ = compare(gpt, GPT_BATCHES[:2], ce_mean, strategy())
    assert bad
    assert not np.allclose(losses[1:], ref_losses[1:], rtol=1e-5)


def test_rows_back_in_order_when_the_last_stage_holds_the_batch_whole():
    """A last stage whose output is replicated over the data ranks (rows not sharded): the logits are put back in
    the batch's order by a local gather, and the gradient reaches each micro-batch's rows (PP2 x DP2, 4 micro-
    batches of 2 rows)."""
    from autoparallel.placement import Replicate

    n, m, dp = 8, 4, 2
    rows = np.arange(n * 3, dtype="float32").reshape(n, 3)
    perm = external_loss.order(n, m, dp)
    assert sorted(perm) == list(range(n)) and perm != list(range(n))
    with ap.simulate(world_size=4):
        pipe, _ = ap.parallelize(gpt(), None, strategy=strategy(dp=2))
        mesh = external_loss.last_mesh(pipe)
        micro = np.split(rows[perm], m)                    # what the stage computes: the permuted batch, cut
        outs = [ap.shard_tensor(paddle.to_tensor(b), mesh, [Replicate(), Replicate()]) for b in micro]
        logits, leaves = external_loss.assemble(pipe, outs, m, dp)
        np.testing.assert_array_equal(logits.numpy(), rows)
        weight = paddle.to_tensor(np.arange(n, dtype="float32").reshape(n, 1))
        (logits * weight).sum().backward()
        for leaf in leaves.values():                       # each leaf row r holds the gradient of batch row perm[r]
            np.testing.assert_array_equal(leaf.grad.numpy()[:, 0], np.asarray(perm, dtype="float32"))
