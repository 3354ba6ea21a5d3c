"""Evaluation metrics users compute from a distributed model's logits, against one process / numpy: token losses
with ``ignore_index`` (``reduction`` none / sum / mean, class weights, ``nll_loss``), masked token accuracy,
boolean-mask indexing, perplexity, ``.tolist()``; uneven masks across data-parallel shards and a final partial
batch whose labels are all ignored."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.testing.models import tp_plan
from examples.models import GPT, GPTConfig

V = 64
_rng = np.random.default_rng(3)
BATCHES = [(_rng.integers(0, V, (b, t)), _rng.integers(0, V, (b, t))) for b, t in [(4, 8), (3, 6), (1, 5)]]
BATCHES[0][1][0:2, :] = -100        # the first data-parallel shard counts fewer tokens than the second
BATCHES[0][1][3, :5] = -100
BATCHES[1][1][2, :] = -100
BATCHES.append((_rng.integers(0, V, (2, 4)), np.full((2, 4), -100)))        # nothing counted
W = np.linspace(0.5, 1.5, V).astype("float32")


def _np_nll(logp, lab, weight=None, ignore=-100):
    """numpy nll_loss mean as paddle defines it: the weighted sum over counted labels / their total weight,
    0 when that total is 0."""
    keep = lab != ignore
    w = np.where(keep, 1.0 if weight is None else weight[np.where(keep, lab, 0)], 0.0)
    picked = np.take_along_axis(logp, np.where(keep, lab, 0)[:, None], axis=1)[:, 0]
    total = w.sum()
    return float(-(picked * w).sum() / total) if total else 0.0


def _log_softmax(x):
    m = x - x.max(-1, keepdims=True)
    return m - np.log(np.exp(m).sum(-1, keepdims=True))


@pytest.mark.parametrize("split", [0, 1], ids=["rows", "classes"])
def test_nll_loss_mean_with_no_counted_label_is_zero_as_in_paddle(split):
    """``nll_loss(reduction="mean")`` divided by a total weight of 0 (every label ``ignore_index``, or only
    classes of weight 0): NaN, where paddle's kernel gives 0 (a last eval batch of padding then turned a summed
    eval loss into NaN). Checked against numpy: paddle's own ``nll_loss`` with an ignored label corrupts the
    heap on CPU (paddle 3.3.1 aborts later in an unrelated free)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype("float32")
    x4 = rng.standard_normal((2, 5, 3, 3)).astype("float32")
    lab4 = rng.choice([0, 1, 2, 3, 4, 255], (2, 3, 3))
    w = np.array([0, 0, 1, 1, 1, 1, 1, 1], "float32")
    cases = [(x, np.full(4, -100), None, -100), (x, np.array([0, 1, 0, -100]), w, -100),
             (x, np.array([2, 1, 7, -100]), w, -100)]
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        for xv, lab, wt, ign in cases:
            got = F.nll_loss(F.log_softmax(ap.shard_tensor(paddle.to_tensor(xv), mesh, [ap.Shard(split)]), -1),
                             paddle.to_tensor(lab), weight=None if wt is None else paddle.to_tensor(wt),
                             ignore_index=ign)
            np.testing.assert_allclose(float(got), _np_nll(_log_softmax(xv), lab, wt, ign), rtol=1e-5, atol=1e-7)
        x4d = ap.shard_tensor(paddle.to_tensor(x4), mesh, [ap.Shard(split)])
        for lab in (np.full((2, 3, 3), 255), lab4):
            got = float(F.nll_loss(F.log_softmax(x4d, 1), paddle.to_tensor(lab), ignore_index=255))
            logp = _log_softmax(np.moveaxis(x4, 1, -1)).reshape(-1, 5)
            np.testing.assert_allclose(got, _np_nll(logp, lab.reshape(-1), None, 255), rtol=1e-5, atol=1e-7)
    assert _np_nll(_log_softmax(x), np.array([2, 1, 7, -100]), w) != 0        # control: a counted label


def gpt():
    paddle.seed(0)
    return GPT(GPTConfig(vocab_size=V, hidden=32, layers=2, heads=4, max_positions=16))


def _val(t):
    if hasattr(t, "full"):
        t = t.full()
    return np.asarray(t.numpy() if hasattr(t, "numpy") else t, dtype="float64")


def evaluate(model):
    model.eval()
    out = []
    with paddle.no_grad():
        for ids, lab in BATCHES:
            o, y = model(paddle.to_tensor(ids)), paddle.to_tensor(lab)
            keep = y != -100
            flat = F.cross_entropy(o.reshape([-1, V]), y.reshape([-1]), ignore_index=-100)
            out.append({
                "none": _val(F.cross_entropy(o, y.unsqueeze(-1), reduction="none", ignore_index=-100)),
                "sum": float(F.cross_entropy(o, y.unsqueeze(-1), reduction="sum", ignore_index=-100)),
                "mean_w": float(F.cross_entropy(o, y.unsqueeze(-1), weight=paddle.to_tensor(W), ignore_index=-100)),
                "ppl": float(paddle.exp(flat)),
                "acc": float(((o.argmax(-1) == y).astype("float32")).sum() / keep.astype("float32").sum()),
                "masked": _val(o[keep].argmax(-1)),
                "count": int(keep.sum()),
                "tolist": o.argmax(-1).tolist(),
            })
    return out


@pytest.mark.parametrize("dp,tp,sp", [(2, 1, False), (1, 2, False), (2, 2, True)], ids=["dp2", "tp2", "dp2xtp2-sp"])
def test_masked_eval_metrics_equal_one_process(dp, tp, sp):
    ref = evaluate(gpt())
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree, s.sequence_parallel.enable = dp, tp, sp
    with ap.simulate(world_size=dp * tp):
        m, _ = ap.parallelize(gpt(), None, strategy=s, tp_plan=tp_plan("gpt") if tp > 1 else None)
        got = evaluate(m)
    assert ref[-1]["count"] == 0 and ref[-1]["sum"] == 0 and ref[0]["count"] < 4 * 8
    for r, g in zip(ref, got):
        assert g["count"] == r["count"] and g["tolist"] == r["tolist"]
        for k in ("none", "sum", "mean_w", "ppl", "acc", "masked"):
            np.testing.assert_allclose(g[k], r[k], rtol=1e-5, atol=1e-6, err_msg=k)
