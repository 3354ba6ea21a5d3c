"""Two real gloo ranks (one job of the shared 2-rank launch): a pipeline driven with an attention mask in a dict of
model inputs, labels with -100 and eval_batch equals one process, and so does the one-process loop on the pipeline
called like the model (loss / 2, two batches per optimizer step) (tests/dist_scripts/pp_forms_worker.py)."""
import os

import numpy as np
import paddle

from autoparallel.parallel.pipeline import auto_split
from autoparallel.testing import paddleformers_models as pf
from dist_scripts import shared_launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_scripts", "pp_forms_worker.py")
JOB = shared_launch.job(__name__, "pp_forms", WORKER, 2, args=lambda out: [out], timeout=200)


def one_process():
    import pp_forms_worker as w

    model = pf.build("llama", num_hidden_layers=3)
    model.eval()
    inputs, labels = w.batch(9)
    with paddle.no_grad():
        eval_loss = float(pf.loss_of(model(**inputs, labels=paddle.to_tensor(labels))))
        logits = auto_split.model_output(model(**inputs)).numpy()
    model.train()
    opt = paddle.optimizer.SGD(0.5, parameters=model.parameters())
    losses = []
    for i in range(2):
        inputs, labels = w.batch(i)
        loss = pf.loss_of(model(**inputs, labels=paddle.to_tensor(labels)))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    params = {n: p.numpy() for n, p in model.named_parameters()}
    called = []
    for i in range(2, 6):                                   # the loop the worker runs on the pipeline, here
        inputs, labels = w.batch(i)
        out = model(**inputs, labels=paddle.to_tensor(labels), return_dict=True)
        (out.loss / 2).backward()
        called.append(float(out.loss))
        if i % 2 == 1:
            opt.step()
            opt.clear_grad()
    _CALLED[:] = [called, {n: p.numpy() for n, p in model.named_parameters()}]
    return eval_loss, logits, losses, params


_CALLED = []


def test_keyword_inputs_ignored_labels_and_eval_on_real_ranks():
    out, ranks = shared_launch.results(JOB)
    eval_loss, logits, losses, params = one_process()
    seen = set()
    for r in ranks:
        np.testing.assert_allclose(r["eval_loss"], eval_loss, rtol=1e-5)
        np.testing.assert_allclose(r["losses"], losses, rtol=1e-5)
        assert r["grads_after_eval"] == 0
        if r["logits"] is not None:                          # the last stage's rank
            np.testing.assert_allclose(np.asarray(r["logits"]), logits, rtol=1e-5, atol=1e-5)
        got = np.load(os.path.join(out, f"forms.rank{r['rank']}.npz"))
        for n in got.files:
            np.testing.assert_allclose(got[n], params[n], rtol=1e-4, atol=2e-5, err_msg=n)
            seen.add(n)
    assert seen == set(params)
    assert sum(r["logits"] is not None for r in ranks) == 1


def test_called_like_the_model_on_real_ranks():
    """Every rank returns the same loss per call (synced), and every parameter equals one process after the loop."""
    out, ranks = shared_launch.results(JOB)
    one_process()
    called, params = _CALLED
    seen = set()
    for r in ranks:
        np.testing.assert_allclose(r["called_losses"], called, rtol=1e-5)
        got = np.load(os.path.join(out, f"called.rank{r['rank']}.npz"))
        for n in got.files:
            np.testing.assert_allclose(got[n], params[n], rtol=1e-4, atol=2e-5, err_msg=n)
            seen.add(n)
    assert seen == set(params)


def test_tied_embedding_with_two_batches_per_step_on_real_ranks():
    """A tied embedding / LM head on two ranks, two train_batch calls (or calls like the model) per optimizer
    step: equal to one process. (Before, each train_batch all-reduced the tied gradient accumulated so far, so
    the first batch's share was summed twice: wte.weight ended 0.58 away.)"""
    import paddle.nn.functional as F

    import pp_common

    model = pp_common.build("gpt", tie=True)
    opt = paddle.optimizer.SGD(0.5, parameters=model.parameters())
    losses = []
    for i, (x, y) in enumerate(pp_common.batches(4)):
        loss = F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
        loss.backward()
        losses.append(float(loss))
        if i % 2:
            opt.step()
            opt.clear_grad()
    params = {n: p.numpy() for n, p in model.named_parameters()}
    out, ranks = shared_launch.results(JOB)
    for mode in ("train_batch", "call"):
        seen = set()
        for r in ranks:
            np.testing.assert_allclose(r["tied_losses"][mode], losses, rtol=1e-5)
            got = np.load(os.path.join(out, f"tied_{mode}.rank{r['rank']}.npz"))
            for n in got.files:
                np.testing.assert_allclose(got[n], params[n], rtol=1e-4, atol=2e-5, err_msg=f"{mode}: {n}")
                seen.add(n)
        assert seen == set(params)
