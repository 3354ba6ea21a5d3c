"""Evaluation as users write it, on a model autoparallel laid out, against one process: ``model.eval()`` and
``paddle.no_grad()`` over an eval set whose batches do not divide the data-parallel degree (7 samples and 1 sample
over dp 4, variable sequence lengths), ``paddle.metric.Accuracy`` update/accumulate and a running mean loss; a
validation loss with gradients enabled; then ``model.train()`` and two training steps (dropout 0.3 on), then the
same evaluation again. Recompute runs in training only (it ran in an eval-mode forward with gradients on)."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
import autoparallel.parallel.recompute as recompute_mod
from autoparallel.testing.models import tp_plan
from examples.models import GPT, GPTConfig

V = 64
_rng = np.random.default_rng(1)
EVAL = [(_rng.integers(0, V, (b, t)), _rng.integers(0, V, (b, t))) for b, t in [(4, 8), (7, 5), (1, 3)]]
TRAIN = [(_rng.integers(0, V, (4, 8)), _rng.integers(0, V, (4, 8))) for _ in range(2)]


def gpt():
    paddle.seed(0)
    return GPT(GPTConfig(vocab_size=V, hidden=32, layers=2, heads=4, max_positions=16, dropout=0.3))


def _np(t):
    return t.full().numpy() if hasattr(t, "full") else t.numpy()


def evaluate(model):
    model.eval()
    acc, total, n, logits = paddle.metric.Accuracy(topk=(1, 32)), 0.0, 0, []
    with paddle.no_grad():
        for ids, lab in EVAL:
            out = model(paddle.to_tensor(ids))
            total += float(F.cross_entropy(out, paddle.to_tensor(lab).unsqueeze(-1)).mean()) * len(ids)
            n += len(ids)
            acc.update(acc.compute(out.reshape([-1, V]), paddle.to_tensor(lab).reshape([-1, 1])))
            logits.append(_np(out))
    ids, lab = EVAL[1]
    val = float(F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(lab).unsqueeze(-1)).mean())
    return {"mean_loss": total / n, "accuracy": acc.accumulate(), "logits": logits, "val_with_grad": val}


def session(model, opt, calls):
    """eval, train two steps, eval again; recompute calls counted in the first evaluation and overall."""
    first = evaluate(model)
    first["recompute_in_eval"] = calls[0]
    model.train()
    losses = []
    for ids, lab in TRAIN:
        loss = F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(lab).unsqueeze(-1)).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return first, losses, evaluate(model), calls[0]


@pytest.fixture
def counted(monkeypatch):
    calls = [0]
    orig = recompute_mod.recompute

    def counting(*a, **k):
        calls[0] += 1
        return orig(*a, **k)

    monkeypatch.setattr(recompute_mod, "recompute", counting)
    return calls


def _reference():
    m = gpt()
    return session(m, paddle.optimizer.SGD(0.1, parameters=m.parameters()), [0])


@pytest.mark.parametrize("dp,tp,stage,rc", [(4, 1, None, False), (2, 2, None, True), (2, 1, 3, True)],
                         ids=["dp4", "dp2xtp2-recompute", "zero3-recompute"])
def test_eval_train_eval_equals_one_process(dp, tp, stage, rc, counted):
    ref = _reference()
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree, s.recompute.enable = dp, tp, rc
    if stage:
        s.sharding.enable, s.sharding.stage = True, stage
    with ap.simulate(world_size=dp * tp):
        m = gpt()
        opt = paddle.optimizer.SGD(0.1, parameters=m.parameters())
        m, opt = ap.parallelize(m, opt, strategy=s, tp_plan=tp_plan("gpt") if tp > 1 else None)
        got = session(m, opt, counted)
        m.train()
        train_mode = _np(m(paddle.to_tensor(EVAL[0][0])))
    for r, g in ((ref[0], got[0]), (ref[2], got[2])):
        assert g["accuracy"] == r["accuracy"] and 0 < r["accuracy"][1] < 1
        np.testing.assert_allclose(g["mean_loss"], r["mean_loss"], rtol=1e-5)
        np.testing.assert_allclose(g["val_with_grad"], r["val_with_grad"], rtol=1e-5)
        for a, b in zip(g["logits"], r["logits"]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5)
    assert not np.allclose(train_mode, ref[2]["logits"][0], atol=1e-3)        # control: dropout is on in train()
    assert got[0]["recompute_in_eval"] == 0
    assert got[3] == (2 * 2 if rc else 0)        # recompute: each training step, once per block (2 blocks)


def test_summing_a_metric_over_ranks_is_refused_with_the_reason():
    """DDP-style code sums a count over ranks; a count computed from the model already covers the global batch
    on every rank (paddle failed with ``must be Tensor, but got DistTensor``). A plain tensor passes through."""
    import paddle.distributed as dist

    from autoparallel import collective_forms

    ids, lab = EVAL[1]
    with ap.simulate(world_size=2):
        m, _ = ap.parallelize(gpt(), None, strategy=_dp2())
        m.eval()
        with paddle.no_grad():
            correct = (m(paddle.to_tensor(ids)).argmax(-1) == paddle.to_tensor(lab)).astype("float32").sum()
        for call in (lambda: dist.all_reduce(correct), lambda: dist.all_gather([], correct)):
            with pytest.raises(TypeError, match="already the whole global batch"):
                call()
    plain = collective_forms._guarded("all_reduce", 0, lambda *a, **k: "reduced")
    assert plain(paddle.ones([1])) == "reduced" and plain(tensor=paddle.ones([1])) == "reduced"


def _dp2():
    s = ap.Strategy()
    s.data_parallel.degree = 2
    return s


@pytest.mark.parametrize("dp", [1, 2])
def test_pipeline_eval_of_a_last_partial_batch_equals_one_process(dp):
    """``pipe.eval()`` left the model's own dropout on (a stage calls the model's ``embed``, which reads the model's
    ``training``), and a batch of 7 or 1 samples over micro_batches 2 x dp was refused: it is padded (labels -100)
    and the outputs cut back. A custom loss_fn is refused there, naming what to pass instead."""
    ref = gpt()
    ref.eval()
    s = ap.Strategy()
    s.pipeline_parallel.degree, s.pipeline_parallel.micro_batches, s.data_parallel.degree = 2, 2, dp
    for ids, lab in [EVAL[0], (EVAL[1][0][:, :5], EVAL[1][1][:, :5]), EVAL[2]]:
        with paddle.no_grad():
            logits = ref(paddle.to_tensor(ids))
            want = float(F.cross_entropy(logits, paddle.to_tensor(lab).unsqueeze(-1)).mean())
        with ap.simulate(world_size=2 * dp):
            pipe, _ = ap.parallelize(gpt(), None, strategy=s)
            pipe.eval()
            loss = float(pipe.eval_batch(paddle.to_tensor(ids), paddle.to_tensor(lab)))
            out = np.asarray(pipe.eval_batch(paddle.to_tensor(ids)))
        np.testing.assert_allclose(loss, want, rtol=1e-5)
        np.testing.assert_allclose(out, logits.numpy(), rtol=1e-5, atol=1e-6)
    with ap.simulate(world_size=2 * dp):
        pipe, _ = ap.parallelize(gpt(), None, strategy=s)
        pipe.loss_fn = lambda logits, y: F.cross_entropy(logits, y).mean()
        with pytest.raises(ValueError, match=r"custom loss_fn.*drop_last=True"):
            pipe.eval_batch(paddle.to_tensor(EVAL[1][0]), paddle.to_tensor(EVAL[1][1]))


class ConvNet(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = paddle.nn.Conv2D(3, 4, 3), paddle.nn.BatchNorm2D(4), paddle.nn.Linear(144, 5)

    def forward(self, x):
        return self.fc(paddle.flatten(F.relu(self.bn(self.conv(x))), 1))


@pytest.mark.parametrize("stage", [2, 3])
def test_batch_norm_running_stats_after_training_under_zero_evaluate_as_one_process(stage):
    """ZeRO-3 released the gathered running mean / variance after a training forward without keeping the
    update (eval outputs off by 0.03); the update now reaches the chunks. ZeRO-2 is the control."""
    rng = np.random.default_rng(7)
    xs = [paddle.to_tensor(rng.standard_normal((6, 3, 8, 8)).astype("float32")) for _ in range(3)]
    ys = [paddle.to_tensor(rng.integers(0, 5, (6, 1))) for _ in range(2)]

    def run(model, opt):
        for x, y in zip(xs, ys):
            model.train()
            F.cross_entropy(model(x), y).mean().backward()
            opt.step()
            opt.clear_grad()
        model.eval()
        with paddle.no_grad():
            return np.asarray(model(xs[2])), np.asarray(model.bn._mean.numpy())

    paddle.seed(0)
    ref = ConvNet()
    want = run(ref, paddle.optimizer.SGD(0.1, parameters=ref.parameters()))
    s = _dp2()
    s.sharding.enable, s.sharding.stage = True, stage
    with ap.simulate(world_size=2):
        paddle.seed(0)
        m = ConvNet()
        m, opt = ap.parallelize(m, paddle.optimizer.SGD(0.1, parameters=m.parameters()), strategy=s)
        got = run(m, opt)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
