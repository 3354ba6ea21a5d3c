"""PaddleFormers training forms outside the causal-LM loss, in the simulated world, against one process.

DPO as PaddleFormers' DPO trainer runs it (``CriterionLayer`` over a config carrying ``dpo_config``, a frozen
reference model, ``labels = (response_labels, response_indexs, reference logps...)``): its log-probabilities of
each response are ``paddle.gather(per_token_logps, response_index[0], axis=0)`` -- a 0-d index, which paddle reads
as one slice with the axis dropped. The ``gather`` rule passed a 0-d index to ``index_select``'s rule
(``IndexError: tuple index out of range`` on every layout); it now gives the slice, the other dims keeping their
sharding. Three AdamW steps of DPO (sigmoid loss with an SFT term) then equal one process under DP 4 and
DP 2 x TP 2 with sequence parallelism: losses, the first step's gradients and every final parameter. On 2 real
gloo ranks too (``dist_scripts/pf8_worker.py``, with GPT-OSS's cached greedy ``generate()`` under TP 2 with
sequence parallelism)."""
import os
import types

import numpy as np
import pytest

from autoparallel.testing import paddleformers_models as pf
from dist_scripts import shared_launch

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import paddle  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel.testing import paddleformers_runs as pr  # noqa: E402


# ---- paddle.gather with a 0-d index ------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1])
@pytest.mark.parametrize("form", ["function", "method", "keyword"])
def test_gather_with_a_0d_index_drops_the_axis_like_paddle(axis, form):
    """Values as paddle's; gradients against numpy: paddle 3.3's own gather gradient with a 0-d index along an
    axis other than 0 is wrong in one process (it adds into positions outside the slice), so the rule's local
    op runs the slice as ``index_select`` of one row then ``squeeze``."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 6, 3)).astype("float32")
    i, a = 2, 0 if axis is None else axis % 3
    kw = {} if axis is None else {"axis": axis}
    call = {"function": lambda t, idx: paddle.gather(t, idx, **kw), "method": lambda t, idx: t.gather(idx, **kw),
            "keyword": lambda t, idx: paddle.gather(x=t, index=idx, **kw)}[form]
    want = np.take(x, i, axis=a)
    want_grad = np.zeros_like(x)
    np.moveaxis(want_grad, a, 0)[i] = 2 * want
    assert list(call(paddle.to_tensor(x), paddle.to_tensor(i, dtype="int32")).shape) == list(want.shape)
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
        dx = ap.shard_tensor(paddle.to_tensor(x), mesh, [ap.Shard(0), ap.Shard(1)], stop_gradient=False)
        got = call(dx, paddle.to_tensor(i, dtype="int32"))
        assert list(got.shape) == list(want.shape)
        np.testing.assert_allclose(got.full().numpy(), want, rtol=1e-6)
        (got * got).sum().backward()
        np.testing.assert_allclose(dx.grad.full().numpy(), want_grad, rtol=1e-6)


def test_gather_with_a_0d_index_keeps_the_other_dims_split():
    """Only the gathered axis is made whole: a batch split over "data" stays split when the gather picks along
    the sequence (no all_gather of the batch)."""
    x = np.arange(4 * 6 * 3, dtype="float32").reshape(4, 6, 3)
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
        dx = ap.shard_tensor(paddle.to_tensor(x), mesh, [ap.Shard(0), ap.Shard(2)])
        got = paddle.gather(dx, paddle.to_tensor(5), axis=1)
        assert str(got.placements) == "[S(0), S(1)]"
        np.testing.assert_array_equal(got.full().numpy(), x[:, 5])


# ---- DPO with PaddleFormers' criterion -----------------------------------------------------------------------
B, T = 4, 10


def dpo_config(**kw):
    """The fields of PaddleFormers' DPOConfig (paddleformers.cli.train.dpo, whose package imports pyarrow)."""
    base = dict(beta=0.1, simpo_gamma=0.5, label_smoothing=0.0, loss_type="sigmoid", pref_loss_ratio=1.0,
                sft_loss_ratio=0.5, dpop_lambda=50, ref_model_update_steps=-1, reference_free=False, lora=False,
                offset_alpha=0.0, normalize_logps=False, ignore_eos_token=False)
    return types.SimpleNamespace(**dict(base, **kw))


def dpo_batch(step):
    """Sequences of T tokens: prompt [0, p), chosen [p, c), rejected [c, r); response_indexs rows [i, p, c, r]."""
    rng = np.random.default_rng(step)
    ids = rng.integers(1, 100, (B, T)).astype("int64")
    labels, idx = np.full((B, T), -100, "int64"), []
    for i in range(B):
        p = 2 + i % 2
        c, r = p + 3, p + 5 + i % 3
        idx.append([i, p, c, r])
        labels[i, p:r] = rng.integers(1, 100, r - p)
    return ids, labels, np.array(idx, "int32")


def _full(t):
    return t.full().numpy() if hasattr(t, "full") else t.numpy()


def train_dpo(strategy=None, steps=3):
    from paddleformers.nn.criterion import CriterionLayer

    model, ref_model = pf.build("llama", 0, fill_zeros=True), pf.build("llama", 0, fill_zeros=True)
    model.config.dpo_config = dpo_config()
    criterion = CriterionLayer(model.config)
    opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters(), epsilon=1e-3)
    if strategy is not None:
        model, opt = ap.parallelize(model, opt, strategy=strategy)
        ref_model, _ = ap.parallelize(ref_model, None, strategy=strategy)
    ref_model.eval()
    rows, grads = [], None
    for step in range(steps):
        ids, labels, idx = dpo_batch(step)
        inputs = {"input_ids": paddle.to_tensor(ids)}
        lab = (paddle.to_tensor(labels), paddle.to_tensor(idx), None, None)
        with paddle.no_grad():
            ref_chosen, ref_rejected = criterion(ref_model(**inputs), lab)
        chosen, rejected, sft, dpo, loss = criterion(model(**inputs), lab[:2] + (ref_chosen, ref_rejected))
        loss.backward()
        if step == 0:
            if strategy is not None:
                opt.reduce_gradients()
            grads = {n: pf._grad_np(p) for n, p in model.named_parameters()}
        opt.step()
        opt.clear_grad()
        rows.append([float(loss), float(sft), float(dpo), *_full(chosen), *_full(rejected)])
    state = ap.full_state_dict(model) if strategy is not None else model.state_dict()
    return np.array(rows), grads, {k: np.asarray(v.numpy()) for k, v in state.items()}


_REF = []


def _reference():
    if not _REF:
        _REF.append(train_dpo())
    return _REF[0]


@pytest.mark.parametrize("dp,tp,sp", [(4, 1, False), (2, 2, True)], ids=["dp4", "dp2xtp2-sp"])
def test_dpo_with_paddleformers_criterion_equals_one_process(dp, tp, sp):
    ref = _reference()
    assert ref[0][0, 0] != ref[0][2, 0] and ref[0][0, 1] > 0       # the loss moves; the SFT term is live
    with ap.simulate(world_size=4):
        got = train_dpo(pr.strategy(dp, tp, sp))
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-5)
    assert [n for n, g in ref[1].items() if not np.allclose(got[1][n], g, rtol=1e-4, atol=1e-5)] == []
    assert [n for n, v in ref[2].items() if not np.allclose(got[2][n], v, rtol=1e-4, atol=1e-5)] == []


# ---- 2 real gloo ranks -------------------------------------------------------------------------------------
JOB = shared_launch.job(__name__, "pf8", os.path.join(os.path.dirname(__file__), "dist_scripts", "pf8_worker.py"), 2,
                        timeout=240)


def test_on_real_ranks_dpo_and_generate_equal_one_process():
    _, ranks = shared_launch.results(JOB)
    assert len(ranks) == 2
    for res in ranks:
        assert [r["case"] for r in res] == ["dpo dp2 tp1", "dpo dp1 tp2", "gpt_oss"]
        for r in res[:2]:
            assert r["bad"] == [], (r["case"], r["bad"])
            assert r["losses"][0] != r["losses"][1]
        assert res[2]["tokens"] == res[2]["ref_tokens"] and len(res[2]["tokens"][0]) == 3


# ---- offsets given as tensors -------------------------------------------------------------------------------
def _i(v):
    return paddle.to_tensor(np.asarray(v, "int64"))


OFFSET_FORMS = {
    "getitem-slice": lambda t: t[:, _i(1):_i(4)],
    "getitem-step": lambda t: t[_i(1):, ::_i(2)],
    "getitem-one-element-1d": lambda t: t[:, _i([1]):_i([5])],
    "response-spans": lambda t: paddle.stack([t[:, :, 0][r[0]][r[1]:r[2]].sum() for r in _i([[0, 1, 4], [2, 0, 6],
                                                                                                [3, 2, 3]])]),
    "setitem-slice": lambda t: _set(t * 1.0, (slice(None), slice(_i(1), _i(3))), 2.0),
    "narrow": lambda t: t.narrow(1, _i(1), 3),
    "slice": lambda t: paddle.slice(t, [1, 2], _i([1, 0]), _i([5, 2])),
    "strided_slice": lambda t: paddle.strided_slice(t, [1], [_i(1)], [_i(6)], [_i(2)]),
    "roll": lambda t: paddle.roll(t, _i(2), axis=1),
    "roll-list": lambda t: paddle.roll(t, [_i(1), 2], axis=[1, 2]),
}


def _set(t, index, value):
    t[index] = value
    return t


@pytest.mark.parametrize("form", list(OFFSET_FORMS))
def test_offsets_given_as_integer_tensors_are_read_as_numbers(form):
    """Paddle reads a 0-d (or one-element) integer tensor where a slice bound, a narrow / slice start or a roll
    shift goes (PaddleFormers' KTO criterion slices ``per_token_logps[r[0]][r[1]:r[2]]`` for each row ``r`` of
    its response indices; the criterion itself fails in one process in PaddleFormers 1.2, so the pattern is run
    here on its own: "response-spans"). On distributed tensors these raised: getitem's ``slice bounds must be
    ints or None``, narrow / slice / strided_slice's ``must be a python int``, roll's rule given the shift as an
    operand."""
    f = OFFSET_FORMS[form]
    x = np.random.default_rng(0).standard_normal((4, 6, 3)).astype("float32")
    rx = paddle.to_tensor(x, stop_gradient=False)
    ref = f(rx)
    (ref * ref).sum().backward()
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
        dx = ap.shard_tensor(paddle.to_tensor(x), mesh, [ap.Shard(0), ap.Shard(1)], stop_gradient=False)
        got = f(dx)
        (got * got).sum().backward()
        np.testing.assert_allclose(got.full().numpy(), ref.numpy(), rtol=1e-6)
        np.testing.assert_allclose(dx.grad.full().numpy(), rx.grad.numpy(), rtol=1e-6)


def test_bounds_that_are_distributed_tensors_are_read_as_their_global_values():
    x = np.arange(4 * 6 * 3, dtype="float32").reshape(4, 6, 3)
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
        dx = ap.shard_tensor(paddle.to_tensor(x), mesh, [ap.Shard(0), ap.Shard(1)])
        s = ap.shard_tensor(_i([1, 4]), mesh, [ap.Shard(0), ap.Replicate()])          # 1 on one rank, 4 on another
        np.testing.assert_array_equal(dx[:, s[0]:s[1]].full().numpy(), x[:, 1:4])
        np.testing.assert_array_equal(dx.narrow(1, s[0], s[1] - s[0]).full().numpy(), x[:, 1:4])
        with pytest.raises(NotImplementedError, match="start must be a python int"):
            dx.narrow(1, paddle.to_tensor(1.0), 2)                   # a float start: refused, as paddle does
