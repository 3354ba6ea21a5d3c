"""A pipeline-parallel model called like the model (parallel/pipeline/called.py), in the simulated world: the
one-process loop ``loss = model(...); (loss / accum).backward(); opt.step()`` on ``ap.parallelize``'s pipeline
equals one process (every step's loss, every rank's shard of every parameter) on the example GPT and a
PaddleFormers Llama under PP2, PP2 x DP2 and PP2 x TP2, SGD and AdamW, with and without ``loss / accum``; the
model's own output forms (a tuple, ``CausalLMOutputWithPast``, a plain loss) with the logits withheld; the
forward-only path under ``paddle.no_grad()`` / ``eval()``; a GradScaler and ``strategy.amp``; pending losses,
backward twice, a backward after a step, a loss never backpropagated; the refusals."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import pp_common

import autoparallel as ap
from autoparallel.dist_tensor import _local_from_full
from autoparallel.parallel.pipeline import call_forms, called
from autoparallel.testing import paddleformers_models as pf
from autoparallel.testing.gpu_scaler import gpu_grad_scaler

RTOL, ATOL, LR = 1e-4, 2e-5, 3e-3
BATCHES = pp_common.batches(4)                     # two optimizer steps of accumulation 2


def make_opt(kind, params):
    return paddle.optimizer.SGD(0.5, parameters=params) if kind == "sgd" else \
        paddle.optimizer.AdamW(LR, parameters=params)


def strategy(dp=1, tp=1, schedule="1F1B"):
    s = ap.Strategy()
    s.pipeline_parallel.degree, s.pipeline_parallel.micro_batches = 2, 4
    s.pipeline_parallel.schedule = schedule
    s.pipeline_parallel.vpp_degree = 2 if schedule == "VPP" else 1
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    return s


def loop(model, opt, call, batches, accum=2, scale=True, scaler=None):
    """The one-process loop; ``call(model, x, y)`` -> loss tensor. Returns the losses."""
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = call(model, paddle.to_tensor(x), paddle.to_tensor(y))
        target = loss / accum if scale else loss
        (scaler.scale(target) if scaler else target).backward()
        losses.append(float(loss))
        if (i + 1) % accum == 0:
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.clear_grad()
    return losses


def gpt_ref_call(m, x, y):
    return F.cross_entropy(m(x), y).mean()


def gpt_pipe_call(m, x, y):
    return m(x, labels=y)


def mismatches(pipe, ref_params, atol=ATOL) -> list:
    bad = []
    for name, p in pipe.named_parameters():
        want = paddle.to_tensor(ref_params[name])
        locals_ = p.locals if hasattr(p, "_ap_spec") else {0: p}
        for r, t in locals_.items():
            w = _local_from_full(want, p.spec, r).numpy() if hasattr(p, "_ap_spec") else want.numpy()
            if not np.allclose(t.numpy(), w, rtol=RTOL, atol=atol):
                bad.append(f"{name}@rank{r}")
    return bad


def gpt_reference(opt_kind, scale=True, batches=BATCHES, scaler=None):
    m = pp_common.build("gpt")
    losses = loop(m, make_opt(opt_kind, m.parameters()), gpt_ref_call, batches, scale=scale, scaler=scaler)
    return losses, {n: p.numpy() for n, p in m.named_parameters()}


def gpt_pipeline(s, opt_kind, world, call=gpt_pipe_call, scale=True, batches=BATCHES, scaler=None, tp_plan=None):
    """(losses, mismatching parameters vs nothing yet, pipe) inside ap.simulate(world)."""
    m = pp_common.build("gpt")
    pipe, opt = ap.parallelize(m, make_opt(opt_kind, m.parameters()), strategy=s, tp_plan=tp_plan)
    return loop(pipe, opt, call, batches, scale=scale, scaler=scaler), pipe, opt


GPT_JOBS = [(1, 1, "sgd", True, "1F1B"), (1, 1, "adamw", False, "1F1B"), (2, 1, "adamw", True, "1F1B"),
            (1, 2, "sgd", True, "1F1B"), (1, 2, "adamw", False, "1F1B"), (1, 2, "sgd", True, "ZB-H1"),
            (2, 1, "adamw", True, "VPP")]


@pytest.mark.parametrize("dp,tp,opt_kind,scale,schedule", GPT_JOBS, ids=lambda v: str(v))
def test_gpt_plain_loop_equals_one_process(dp, tp, opt_kind, scale, schedule):
    from autoparallel.testing.models import tp_plan

    ref_losses, ref_params = gpt_reference(opt_kind, scale)
    with ap.simulate(world_size=2 * dp * tp):
        losses, pipe, _ = gpt_pipeline(strategy(dp, tp, schedule), opt_kind, 2 * dp * tp, scale=scale,
                                       tp_plan=tp_plan("gpt") if tp > 1 else None)
        bad = mismatches(pipe, ref_params)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert bad == []


@pytest.mark.parametrize("extra", [{"clip": 0.05}, {"zero": 2}, {"zero": 1, "clip": 0.05}], ids=str)
def test_gpt_plain_loop_with_clip_and_zero_equals_one_process(extra):
    """ClipGradByGlobalNorm (binding) and ZeRO 1 / 2 inside the stages act at opt.step() on the accumulated
    gradients, as in one process (PP2 x DP2, AdamW)."""
    def make(params):
        clip = paddle.nn.ClipGradByGlobalNorm(extra["clip"]) if "clip" in extra else None
        return paddle.optimizer.AdamW(LR, parameters=params, grad_clip=clip)

    ref = pp_common.build("gpt")
    ref_losses = loop(ref, make(ref.parameters()), gpt_ref_call, BATCHES)
    ref_params = {n: p.numpy() for n, p in ref.named_parameters()}
    s = strategy(dp=2)
    if "zero" in extra:
        s.sharding.enable, s.sharding.stage = True, extra["zero"]
    with ap.simulate(world_size=4):
        m = pp_common.build("gpt")
        pipe, opt = ap.parallelize(m, make(m.parameters()), strategy=s)
        losses = loop(pipe, opt, gpt_pipe_call, BATCHES)
        bad = mismatches(pipe, ref_params)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert bad == []


def test_negative_control_upstream_gradient_ignored(monkeypatch):
    """Adding the held gradients without the factor g (as if loss / 2 were loss) must break equality."""
    ref_losses, ref_params = gpt_reference("sgd")
    apply = called._Ticket.apply
    monkeypatch.setattr(called._Ticket, "apply", lambda self, g: apply(self, paddle.ones_like(g)))
    with ap.simulate(world_size=2):
        _, pipe, _ = gpt_pipeline(strategy(), "sgd", 2)
        assert mismatches(pipe, ref_params)


# ---- PaddleFormers Llama: the model's own output forms ---------------------------------------------------------
def llama():
    return pf.build("llama", tie_word_embeddings=False, num_hidden_layers=4)


def llama_batches():
    return [pf.batch(i, b=8, t=8) for i in range(4)]


def llama_dict_call(m, x, y):                    # loss = model(**batch).loss
    return m(**{"input_ids": x, "labels": y, "return_dict": True}).loss


def llama_tuple_call(m, x, y):                   # loss = model(ids, labels=labels)[0]
    return m(x, labels=y)[0]


# AdamW divides by the root of the second moment: on the Llama one weight element of 8192 whose gradient is near
# zero moves 4.7e-5 apart (the step is 3e-3) from float sums in another order; SGD jobs keep the tight tolerance
LLAMA_JOBS = [(1, 1, "sgd", llama_dict_call), (2, 1, "sgd", llama_tuple_call), (1, 2, "sgd", llama_tuple_call),
              (1, 1, "adamw", llama_dict_call), (2, 1, "adamw", llama_dict_call)]


@pytest.mark.skipif(not pf.available(), reason="PaddleFormers is not installed")
@pytest.mark.parametrize("dp,tp,opt_kind,call", LLAMA_JOBS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_llama_plain_loop_equals_one_process(dp, tp, opt_kind, call):
    ref = llama()
    ref_losses = loop(ref, make_opt(opt_kind, ref.parameters()), call, llama_batches())
    ref_params = {n: p.numpy() for n, p in ref.named_parameters()}
    with ap.simulate(world_size=2 * dp * tp):
        m = llama()
        pipe, opt = ap.parallelize(m, make_opt(opt_kind, m.parameters()), strategy=strategy(dp, tp))
        losses = loop(pipe, opt, call, llama_batches())
        bad = mismatches(pipe, ref_params, atol=1e-4 if opt_kind == "adamw" else ATOL)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert bad == []


@pytest.mark.skipif(not pf.available(), reason="PaddleFormers is not installed")
def test_llama_output_forms_and_forward_only_calls():
    from paddleformers.transformers.model_outputs import CausalLMOutputWithPast

    ref = llama()
    x, y = (paddle.to_tensor(v) for v in pf.batch(0, b=4, t=8))
    ref.eval()
    with paddle.no_grad():
        ref_loss = float(ref(x, labels=y)[0])
        ref_logits = ref(x, return_dict=True).logits.numpy()
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(llama(), None, strategy=strategy())
        out = pipe(x, labels=y, return_dict=True)
        assert type(out) is CausalLMOutputWithPast and not out.loss.stop_gradient
        with pytest.raises(NotImplementedError, match="logits of a training step .* not kept"):
            out.logits.shape
        pair = pipe(x, labels=y)                              # return_dict=False: (loss, logits)
        assert type(pair) is tuple and len(pair) == 2
        loss, logits = pair
        with pytest.raises(NotImplementedError, match="not provided"):
            logits.numpy()
        np.testing.assert_allclose([float(out.loss), float(loss)], [ref_loss] * 2, rtol=1e-5)
        pipe.eval()                                           # forward only: the loss, then the logits
        ev = pipe(x, labels=y, return_dict=True)
        assert not ev.loss.stop_gradient                     # a backward through it raises (forward only)
        np.testing.assert_allclose(float(ev.loss), ref_loss, rtol=1e-5)
        with pytest.raises(NotImplementedError, match="call it without labels for the logits"):
            ev.logits + 1
        np.testing.assert_allclose(pipe(x, return_dict=True).logits.numpy(), ref_logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(pipe(input_ids=x)[0].numpy(), ref_logits, rtol=1e-5, atol=1e-5)
        assert all(p.grad is None for p in pipe.parameters())


def test_gpt_forms_no_grad_eval_and_refusals():
    ref = pp_common.build("gpt")
    x, y = (paddle.to_tensor(v) for v in BATCHES[0])
    with paddle.no_grad():
        ref_logits = ref(x).numpy()
        ref_loss = float(F.cross_entropy(ref(x), y).mean())
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(pp_common.build("gpt"), None, strategy=strategy())
        loss = pipe(x, labels=y)                              # a model without labels: the plain loss
        assert isinstance(loss, paddle.Tensor) and loss.shape == [] and not loss.stop_gradient
        np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
        with paddle.no_grad():                                # training mode, no gradient: forward only
            np.testing.assert_allclose(pipe(x).numpy(), ref_logits, rtol=1e-5, atol=1e-5)
            assert pipe(x, labels=y).stop_gradient
        assert all(p.grad is None for p in pipe.parameters())
        with pytest.raises(TypeError, match=r"schedule was set to '1F1B': call model\(x, labels=y\)"):
            pipe(x)                                           # loss_fn(model(x), y) needs FThenB (external_loss.py)
        with pytest.raises(TypeError, match=r"called with the arguments of GPT.forward"):
            pipe(x, y)
        with pytest.raises(TypeError, match="missing a required argument: 'ids'"):
            pipe(labels=y)


def test_low_precision_parameters_refused():
    x, y = (paddle.to_tensor(v) for v in BATCHES[0])
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(pp_common.build("gpt"), None, strategy=strategy())
        pipe.stages[0].add_parameter("lowp", paddle.create_parameter([2], dtype="float16"))
        with pytest.raises(NotImplementedError, match="float16 parameters called like the model"):
            pipe(x, labels=y)


# ---- gradients: pending losses, backward twice, after a step, never --------------------------------------------
def one_process_grads(body):
    """{name: gradient} after ``body(model, batches as tensors)`` in one process."""
    m = pp_common.build("gpt")
    body(m, gpt_ref_call)
    return {n: p.grad.numpy() for n, p in m.named_parameters() if p.grad is not None}


def pipeline_grads(body):
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(pp_common.build("gpt"), None, strategy=strategy())
        body(pipe, gpt_pipe_call)
        return {n: p.grad.numpy() for n, p in pipe.named_parameters() if p.grad is not None}


def tensors(i):
    return [paddle.to_tensor(v) for v in BATCHES[i]]


def two_pending(m, call):
    l1, l2 = call(m, *tensors(0)), call(m, *tensors(1))
    ((l1 + l2) / 2).backward()


def retain_twice(m, call):
    loss = call(m, *tensors(0)) * 0.25
    loss.backward(retain_graph=True)
    loss.backward()


def never_then_one(m, call):
    call(m, *tensors(0))                                     # never backpropagated: changes nothing
    call(m, *tensors(1)).backward()


def accumulate_after_clear(m, call):
    call(m, *tensors(0)).backward()
    m.clear_gradients()
    loss = call(m, *tensors(1))
    (loss * 0.5).backward()


def quarter(m, call):
    (call(m, *tensors(0)) * 0.25).backward()


def test_backward_twice_with_retain_graph_adds_twice():
    """Twice the gradients of one backward. (One process with paddle 3.3.1 does not give that on this GPT: its
    second backward through a retained graph differs from the first by up to 20% of the gradient, so the
    mathematical value is the reference here.)"""
    want, got = one_process_grads(quarter), pipeline_grads(retain_twice)
    assert set(got) == set(want)
    for n in want:
        np.testing.assert_allclose(got[n], 2 * want[n], rtol=1e-4, atol=1e-6, err_msg=n)


@pytest.mark.parametrize("body", [two_pending, never_then_one, accumulate_after_clear], ids=lambda f: f.__name__)
def test_gradients_equal_one_process(body):
    want, got = one_process_grads(body), pipeline_grads(body)
    assert set(got) == set(want)
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-4, atol=1e-6, err_msg=n)


def test_backward_twice_without_retain_graph_raises_and_adds_once():
    def body(m, call):
        loss = call(m, *tensors(0))
        loss.backward()
        with pytest.raises(Exception, match="backward twice|TensorWrappers"):
            loss.backward()

    want, got = one_process_grads(body), pipeline_grads(body)
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-4, atol=1e-6, err_msg=n)


def test_aux_term_of_other_parameters_and_backward_after_a_step():
    x, y = tensors(0)
    with ap.simulate(world_size=2):
        m = pp_common.build("gpt")
        pipe, opt = ap.parallelize(m, make_opt("sgd", m.parameters()), strategy=strategy())
        extra = paddle.create_parameter([3], dtype="float32")
        (pipe(x, labels=y) + (extra * extra).sum()).backward()
        np.testing.assert_allclose(extra.grad.numpy(), 2 * extra.numpy(), rtol=1e-6)
        opt.clear_grad()
        l1, l2 = pipe(x, labels=y), pipe(*tensors(1)[:1], labels=tensors(1)[1])
        l2.backward()
        opt.step()
        before = [p.grad.numpy() for p in pipe.parameters()]
        with pytest.raises(OSError, match="RuntimeError: backward.* after its parameters were changed in place"):
            l1.backward()                       # paddle re-raises a hook's error as OSError "(External) ..."
        for p, g in zip(pipe.parameters(), before):                  # nothing added
            np.testing.assert_array_equal(p.grad.numpy(), g)


def test_train_batch_unchanged_next_to_calls():
    """A step of calls, then a train_batch step: equal to one process doing both steps."""
    ref_losses, ref_params = gpt_reference("adamw", batches=BATCHES[:2] + [BATCHES[2]] * 2, scale=True)
    with ap.simulate(world_size=2):
        m = pp_common.build("gpt")
        pipe, opt = ap.parallelize(m, make_opt("adamw", m.parameters()), strategy=strategy())
        losses = loop(pipe, opt, gpt_pipe_call, BATCHES[:2])
        x, y = BATCHES[2]
        losses.append(pipe.train_batch(x, y))
        opt.step()
        bad = mismatches(pipe, ref_params)
    np.testing.assert_allclose(losses, ref_losses[:3], rtol=1e-5)
    assert bad == []


# ---- loss scaling ----------------------------------------------------------------------------------------------
def test_grad_scaler_scaled_loss_backward_equals_one_process():
    ref_losses, ref_params = gpt_reference("sgd", scaler=gpu_grad_scaler(init_loss_scaling=1024))
    with ap.simulate(world_size=4):
        scaler = gpu_grad_scaler(init_loss_scaling=1024)
        losses, pipe, _ = gpt_pipeline(strategy(dp=2), "sgd", 4, scaler=scaler)
        bad = mismatches(pipe, ref_params)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert bad == []


def test_strategy_amp_float16_loss_backward_equals_train_batch():
    """strategy.amp float16: the step runs on the strategy's own loss scale; loss.backward() and opt.step() give
    what train_batch gives (the tested path, test_pipeline_compose.py)."""
    job = {"schedule": "1F1B", "amp": "float16"}

    def run(use_call):
        with ap.simulate(world_size=2):
            m = pp_common.build("gpt")
            pipe, opt = ap.parallelize(m, pp_common.optimizer(m.parameters(), sgd=True), strategy=pp_common.strategy(job))
            losses = []
            for x, y in BATCHES[:2]:
                if use_call:
                    loss = pipe(paddle.to_tensor(x), labels=paddle.to_tensor(y))
                    loss.backward()
                    losses.append(float(loss))
                else:
                    losses.append(pipe.train_batch(x, y))
                opt.step()
                opt.clear_grad()
            return losses, {n: p.numpy() for n, p in pipe.named_parameters()}

    (a, pa), (b, pb) = run(True), run(False)
    np.testing.assert_allclose(a, b, rtol=1e-6)
    for n in pa:
        np.testing.assert_allclose(pa[n], pb[n], rtol=1e-6, atol=1e-7, err_msg=n)


def test_withheld_value_names_itself():
    w = call_forms.Withheld("the logits", "a reason")
    for use in (lambda: w.shape, lambda: w[0], lambda: np.asarray(w), lambda: float(w), lambda: w * 2):
        with pytest.raises(NotImplementedError, match="the logits of a pipeline-parallel model's call is not "
                                                      "provided: a reason"):
            use()


@pytest.mark.skipif(not pf.available(), reason="PaddleFormers is not installed")
def test_form_dry_runs_leave_modes_and_random_state_alone():
    from autoparallel.parallel.pipeline.stage import describe_model

    model = llama()
    model.model.layers[1].eval()                              # mixed modes stay mixed
    pieces = describe_model(model)
    paddle.seed(5)
    want = paddle.rand([3]).numpy()
    paddle.seed(5)
    forms = call_forms.detect(model, pieces)
    got = paddle.rand([3]).numpy()
    np.testing.assert_array_equal(got, want)
    assert [layer.training for layer in model.model.layers] == [True, False, True, True]
    assert forms[(True, None)].cls is tuple and forms[(True, True)].cls.__name__ == "CausalLMOutputWithPast"
    assert dict(forms[(True, True)].slots) == {"loss": "loss", "logits": "logits"}
