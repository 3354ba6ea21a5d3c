"""Cross entropy on sharded logits equals one process for the label forms users write: ignore_index -100 (one data
shard holding only ignored labels), a custom ignore_index, class weights, soft labels, label smoothing, every
reduction, labels [b, s] or [b, s, 1], int32 or int64, the class axis not last. paddle's mean divides by the number
of examples with the default ignore_index -100 (ignored ones included) and by the count of valid labels with an
ignore_index >= 0: the sharded loss divides by the same global divisor (in the simulated world). Class weights
get paddle's gradient too (through the weighted sum and the divisor)."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.testing import models as M

S0, R, C = ap.Shard(0), ap.Replicate(), 7                # 7 classes: uneven over a vocab split of 2 or 4
RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 6, C)).astype("float32")
Y = RNG.integers(0, C, (4, 6))
Y_IGN = Y.copy()
Y_IGN[:2] = -100                                         # data shard 0 (rows 0, 1 of 4 over dp 2) all ignored
Y_IGN[3, :2] = -100
WEIGHT = RNG.uniform(0.5, 2.0, C).astype("float32")
SOFT = RNG.uniform(size=(4, 6, C)).astype("float32")
SOFT /= SOFT.sum(-1, keepdims=True)
LAYOUTS = {"dp4": (["d"], [S0], [S0]), "vocab4": (["m"], [ap.Shard(2)], [R]),
           "dp2xvocab2": (["d", "m"], [S0, ap.Shard(2)], [S0, R]), "seq2xvocab2": (["d", "m"], [ap.Shard(1), ap.Shard(2)],
                                                                                  [ap.Shard(1), R])}


def _loss(x, y, w, kw):
    loss = F.cross_entropy(x, y, weight=w, **kw)
    return loss, (loss.sum() if kw.get("reduction") == "none" else loss)


def _one(y, kw, weight=False):
    x, w = paddle.to_tensor(X, stop_gradient=False), paddle.to_tensor(WEIGHT, stop_gradient=False)
    loss, scalar = _loss(x, paddle.to_tensor(y), w if weight else None, kw)
    scalar.backward()
    return loss.numpy(), x.grad.numpy(), w.grad.numpy() if weight else None      # paddle trains class weights too


def _sharded(y, kw, layout, weight=False):
    dims, xpl, ypl = LAYOUTS[layout]
    if kw.get("soft_label"):
        ypl = xpl
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh(np.arange(4).reshape([2, 2] if len(dims) == 2 else [4]).tolist(), dim_names=dims)
        x = ap.shard_tensor(paddle.to_tensor(X, stop_gradient=False), mesh, xpl)
        w = ap.shard_tensor(paddle.to_tensor(WEIGHT, stop_gradient=False), mesh, [R] * len(dims)) if weight else None
        loss, scalar = _loss(x, ap.shard_tensor(paddle.to_tensor(y), mesh, ypl), w, kw)
        scalar.backward()
        return loss.full().numpy(), x.grad.full().numpy(), w.grad.full().numpy() if weight else None


CASES = {
    "ignore-100-mean": (Y_IGN, {}, False),
    "ignore-100-mean-weight": (Y_IGN, {}, True),
    "ignore-100-sum-int32": (Y_IGN.astype("int32"), {"reduction": "sum"}, False),
    "ignore-100-none-label-b-s-1": (Y_IGN[..., None], {"reduction": "none"}, False),
    "ignore-100-none-label-b-s": (Y_IGN, {"reduction": "none"}, False),
    "custom-ignore-3-mean-weight": (Y, {"ignore_index": 3}, True),
    "custom-ignore-all-ignored": (np.full_like(Y, 3), {"ignore_index": 3}, False),
    "soft-label-mean-weight": (SOFT, {"soft_label": True}, True),
    "label-smoothing-mean-weight": (Y, {"label_smoothing": 0.2}, True),
    "label-smoothing-none": (Y, {"label_smoothing": 0.2, "reduction": "none"}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cross_entropy_label_forms_equal_one_process(case):
    y, kw, weight = CASES[case]
    ref = _one(y, kw, weight)
    for layout in LAYOUTS:
        got = _sharded(y, kw, layout, weight)
        assert got[0].shape == ref[0].shape, (layout, got[0].shape, ref[0].shape)
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6, err_msg=layout)
        np.testing.assert_allclose(got[1], ref[1], rtol=1e-4, atol=1e-6, err_msg=layout)
        if weight:
            np.testing.assert_allclose(got[2], ref[2], rtol=1e-4, atol=1e-6, err_msg=f"{layout}: weight gradient")


def test_mean_divisor_is_paddles():
    """Negative control of the divisor: with -100 labels paddle's mean counts the ignored examples, with an
    ignore_index >= 0 it does not (the same labels, two values); a data shard with no valid label adds 0."""
    mean_all = _one(Y_IGN, {})[0]
    mean_valid = _one(np.where(Y_IGN < 0, C, Y_IGN), {"ignore_index": C})[0]
    assert not np.isclose(mean_all, mean_valid)
    assert np.isclose(mean_all * Y_IGN.size, mean_valid * (Y_IGN >= 0).sum(), rtol=1e-5)
    assert np.isclose(_sharded(np.where(Y_IGN < 0, C, Y_IGN), {"ignore_index": C}, "dp2xvocab2")[0], mean_valid)


def test_axis_1_vocab_parallel_and_unsupported_forms_raise():
    xa = np.moveaxis(X, 2, 1)
    ref = F.cross_entropy(paddle.to_tensor(xa), paddle.to_tensor(Y_IGN), axis=1).numpy()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["m"])
        x = ap.shard_tensor(paddle.to_tensor(xa), mesh, [ap.Shard(1)])
        y = ap.shard_tensor(paddle.to_tensor(Y_IGN), mesh, [R])
        np.testing.assert_allclose(F.cross_entropy(x, y, axis=1).full().numpy(), ref, rtol=1e-5)
        x = ap.shard_tensor(paddle.to_tensor(X), mesh, [ap.Shard(2)])
        with pytest.raises(NotImplementedError, match="use_softmax=False"):
            F.cross_entropy(x, y, use_softmax=False)
        with pytest.raises(NotImplementedError, match="ignore_index=3 with a soft or smoothed label"):
            F.cross_entropy(x, ap.shard_tensor(paddle.to_tensor(Y), mesh, [R]), label_smoothing=0.1, ignore_index=3)
        with pytest.raises(ValueError, match=r"label_smoothing: every label must be a class index in \[0, 7\)"):
            F.cross_entropy(x, y, label_smoothing=0.1)


def test_ids_and_labels_no_rank_holds_raise_as_on_one_process():
    """A label >= the class count (a tokenizer larger than the model) or an id >= the vocabulary: one process
    raises; split over the vocab, no rank held it and it counted silently as a zero logit / embedding row."""
    x, w = paddle.to_tensor(X), paddle.to_tensor(X[0])
    bad_lab, bad_ids = paddle.to_tensor(np.where(Y_IGN == 6, C, Y_IGN)), paddle.to_tensor([[1, 6, 9]])
    with pytest.raises(IndexError):
        F.cross_entropy(x, bad_lab)
    with pytest.raises(ValueError):
        F.embedding(bad_ids, w)
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["m"])
        xs, ws = ap.shard_tensor(x, mesh, [ap.Shard(2)]), ap.shard_tensor(w, mesh, [ap.Shard(0)])
        with pytest.raises(IndexError, match=r"labels other than ignore_index=-100 must be in \[0, 7\).*got \[7"):
            F.cross_entropy(xs, ap.shard_tensor(bad_lab, mesh, [R]))
        with pytest.raises(ValueError, match=r"embedding: input ids must be in \[0, 6\).*got \[6, 9\]"):
            F.embedding(ap.shard_tensor(bad_ids, mesh, [R]), ws)
        ok = F.embedding(ap.shard_tensor(paddle.to_tensor([[1, -1, 5]]), mesh, [R]), ws).full().numpy()
    # paddle's kernel lets -1 through (it fills no defined row); split, it is a zero row; the others equal paddle's
    np.testing.assert_array_equal(ok[0, [0, 2]], X[0][[1, 5]])
    assert not ok[0, 1].any()


def test_project_gpt_with_ignored_labels_under_dp_and_vocab_parallel_trains_as_one_process():
    """The project's GPT with -100 labels (data shard 0 holds none valid): one SGD step under dp2 x tp2 with a
    vocab-parallel embedding and head (the loss is computed on vocab-split logits) equals one process."""
    ids, lab = M.batch(0)
    lab[:2], lab[3, :3] = -100, -100

    def step(layout=None):
        model = M.build("gpt", 0)
        opt = paddle.optimizer.SGD(0.5, parameters=model.parameters())
        if layout:
            s = ap.Strategy()
            s.data_parallel.degree, s.tensor_parallel.degree = layout
            model, opt = ap.parallelize(model, opt, strategy=s, tp_plan=M.tp_plan("gpt"))
        loss = F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(lab))
        loss.backward()
        opt.step()
        return float(loss), {n: (p.full() if hasattr(p, "full") else p).numpy() for n, p in model.named_parameters()}

    ref = step()
    with ap.simulate(world_size=4):
        got = step((2, 2))
    assert np.isclose(got[0], ref[0], rtol=1e-5)
    for n, v in ref[1].items():
        np.testing.assert_allclose(got[1][n], v, rtol=1e-4, atol=1e-5, err_msg=n)
