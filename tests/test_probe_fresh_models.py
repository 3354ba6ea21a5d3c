"""Hand-written models a demanding user trains, against one process (losses and every parameter after 3 steps,
simulated 4-rank world): a top-2 mixture of experts routed with ``topk`` / ``nonzero`` / ``gather`` /
``index_add`` plus a load-balancing term (DP 4, DP 2 x TP 2 over the experts' Linears, ZeRO-3); masked-language
modelling reading the masked positions with ``masked_select`` (DP 4, DP 2 x TP 2, TP 4 + SP); packed sequences
with a block-diagonal causal mask built from segment ids and per-segment positions (DP, DP x TP, TP + SP, ZeRO-3);
a custom ``PyLayer`` activation between a column- and a row-parallel Linear; layers whose sizes the TP degree does
not divide (6 hidden units, 3 gate units, a 6-row vocabulary over 4 ranks) with AdamW and a global-norm clip under
TP, TP + SP, ZeRO 1/2/3; and optimizer forms combined (parameter groups with their own learning-rate multiplier
and weight decay, LinearWarmup over CosineAnnealingDecay, ClipGradByNorm / ByValue, apply_decay_param_fun with
multi_precision, Nesterov Momentum with L2Decay and set_lr mid-run) under ZeRO-3 x TP and ZeRO-1 x TP + SP."""
import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.testing.models import batch, build, tp_plan

D = 16


def _strategy(dp=1, tp=1, zero=0, sp=False):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    if zero:
        s.sharding.enable, s.sharding.stage = True, zero
    s.sequence_parallel.enable = sp
    return s


def _full(t):
    return t.full().numpy() if hasattr(t, "full") else t.numpy()


def _sgd(ps):
    return paddle.optimizer.SGD(0.3, parameters=ps)


def _run(model, opt, loss_of, steps, lr_at=None):
    losses, lrs = [], []
    for i in range(steps):
        if lr_at and i in lr_at:
            opt.set_lr(lr_at[i])
        loss = loss_of(model, i)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
        lrs.append(opt.get_lr())
        sched = getattr(opt, "_learning_rate", None)
        if hasattr(sched, "step"):
            sched.step()
    return losses, lrs


def _compare(build_model, loss_of, strategy, plan=None, make_opt=_sgd, steps=3, lr_at=None, rtol=2e-4, atol=3e-5):
    paddle.seed(0)
    ref = build_model()
    want, want_lrs = _run(ref, make_opt(ref.parameters()), loss_of, steps, lr_at)
    paddle.seed(0)
    with ap.simulate(world_size=4):
        m = build_model()
        kw = {"tp_plan": plan} if plan is not None else {}
        m, opt = ap.parallelize(m, make_opt(m.parameters()), strategy=strategy, **kw)
        got, lrs = _run(m, opt, loss_of, steps, lr_at)
        params = {n: _full(p) for n, p in m.named_parameters()}
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lrs, want_lrs, rtol=1e-12)
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(params[n], p.numpy(), rtol=rtol, atol=atol, err_msg=n)
    return want


def _x(shape, seed):
    return paddle.to_tensor(np.random.default_rng(seed).standard_normal(shape).astype("float32"))


# ---- a mixture of experts written by hand ---------------------------------------------------------------------------
class MoE(nn.Layer):
    def __init__(self, experts=4, k=2):
        super().__init__()
        self.inp, self.gate, self.out = nn.Linear(8, D), nn.Linear(D, experts, bias_attr=False), nn.Linear(D, 5)
        self.experts = nn.LayerList([nn.Sequential(nn.Linear(D, 32), nn.GELU(), nn.Linear(32, D))
                                     for _ in range(experts)])
        self.k = k

    def forward(self, x):
        h = self.inp(x)
        b, t, _ = h.shape
        flat = h.reshape([-1, D])
        probs = F.softmax(self.gate(flat), axis=-1)
        w, idx = paddle.topk(probs, self.k, axis=-1)
        w = w / w.sum(-1, keepdim=True)
        out = paddle.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            hit = idx == e
            rows = paddle.nonzero(hit.any(-1)).squeeze(-1)
            if rows.shape[0] == 0:
                continue
            we = (w * hit.astype(w.dtype)).sum(-1)
            out = paddle.index_add(out, rows, 0, expert(paddle.gather(flat, rows)) * paddle.gather(we, rows).unsqueeze(-1))
        aux = (probs.mean(0) ** 2).sum() * 4
        return self.out(out.reshape([b, t, D]) + h), aux


MOE_X = [_x((4, 6, 8), i) for i in range(3)]
MOE_Y = [paddle.to_tensor(np.random.default_rng(i).integers(0, 5, (4, 6))) for i in range(3)]


def _moe_loss(m, i):
    logits, aux = m(MOE_X[i])
    return F.cross_entropy(logits, MOE_Y[i]) + 0.1 * aux


@pytest.mark.parametrize("layout", ["dp4", "dp2-tp2", "dp4-zero3"])
def test_hand_written_mixture_of_experts(layout):
    s = {"dp4": _strategy(4), "dp2-tp2": _strategy(2, 2), "dp4-zero3": _strategy(4, zero=3)}[layout]
    plan = {"experts.*.0": ap.ColWiseParallel(), "experts.*.2": ap.RowWiseParallel()} if "tp" in layout else None
    want = _compare(MoE, _moe_loss, s, plan)
    assert want[2] < want[0]


# ---- masked-language modelling over masked_select ---------------------------------------------------------------------
class MLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, D)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, 4, 32, dropout=0.0), 1)
        self.lm = nn.Linear(D, 40)

    def forward(self, ids, masked):
        h = self.enc(self.emb(ids))
        return self.lm(paddle.masked_select(h, masked.unsqueeze(-1).expand_as(h)).reshape([-1, D]))


_R = np.random.default_rng(0)
MLM_IDS = [_R.integers(0, 40, (4, 7)) for _ in range(3)]
MLM_POS = [_R.random((4, 7)) < 0.3 for _ in range(3)]
ENC_PLAN = {"enc.layers.*.self_attn.q_proj": "col", "enc.layers.*.self_attn.k_proj": "col",
            "enc.layers.*.self_attn.v_proj": "col", "enc.layers.*.self_attn.out_proj": "row",
            "enc.layers.*.linear1": "col", "enc.layers.*.linear2": "row", "lm": "col"}


def _styles(plan):
    return {k: ap.ColWiseParallel() if v == "col" else ap.RowWiseParallel() for k, v in plan.items()}


def _mlm_loss(m, i):
    return F.cross_entropy(m(paddle.to_tensor(MLM_IDS[i]), paddle.to_tensor(MLM_POS[i])),
                           paddle.to_tensor(MLM_IDS[i][MLM_POS[i]]))


@pytest.mark.parametrize("layout", ["dp4", "dp2-tp2", "tp4-sp"])
def test_masked_language_modelling_over_masked_select(layout):
    s = {"dp4": _strategy(4), "dp2-tp2": _strategy(2, 2), "tp4-sp": _strategy(tp=4, sp=True)}[layout]
    _compare(MLM, _mlm_loss, s, _styles(ENC_PLAN) if "tp" in layout else None)


# ---- packed sequences: a block-diagonal causal mask from segment ids --------------------------------------------------
class Packed(nn.Layer):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(40, D), nn.Embedding(16, D)
        self.attn = nn.MultiHeadAttention(D, 4)
        self.lm = nn.Linear(D, 40)

    def forward(self, ids, seg, pos):
        h = self.emb(ids) + self.pos(pos)
        t = ids.shape[1]
        mask = paddle.logical_and(seg.unsqueeze(2) == seg.unsqueeze(1), paddle.tril(paddle.ones([t, t], dtype="bool")))
        return self.lm(h + self.attn(h, h, h, attn_mask=mask.unsqueeze(1)))


SEGS = np.array([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1]])
POS = np.stack([np.concatenate([np.arange((s == k).sum()) for k in np.unique(s)]) for s in SEGS])
PACKED_IDS = [_R.integers(0, 40, (4, 8)) for _ in range(3)]
ATTN_PLAN = {"attn.q_proj": "col", "attn.k_proj": "col", "attn.v_proj": "col", "attn.out_proj": "row", "lm": "col"}


def _packed_loss(m, i):
    logits = m(paddle.to_tensor(PACKED_IDS[i]), paddle.to_tensor(SEGS), paddle.to_tensor(POS))
    return F.cross_entropy(logits, paddle.to_tensor(np.roll(PACKED_IDS[i], -1, 1)))


@pytest.mark.parametrize("layout", ["dp4", "dp2-tp2", "tp4-sp", "dp2-tp2-zero3"])
def test_packed_sequences_with_a_segment_mask(layout):
    s = {"dp4": _strategy(4), "dp2-tp2": _strategy(2, 2), "tp4-sp": _strategy(tp=4, sp=True),
         "dp2-tp2-zero3": _strategy(2, 2, zero=3)}[layout]
    _compare(Packed, _packed_loss, s, _styles(ATTN_PLAN) if "tp" in layout else None)


# ---- a custom PyLayer between a column- and a row-parallel Linear -------------------------------------------------------
class Swish(paddle.autograd.PyLayer):
    @staticmethod
    def forward(ctx, x):
        s = F.sigmoid(x)
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensor()
        return g * (s + x * s * (1 - s))


class WithSwish(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(12, 16), nn.Linear(16, 12), nn.Linear(12, 3)

    def forward(self, x):
        return self.out(self.fc2(Swish.apply(self.fc1(x))))


SW_X = [_x((8, 12), i) for i in range(3)]


@pytest.mark.parametrize("dp,tp,zero", [(2, 2, 0), (1, 4, 3)])
def test_a_custom_pylayer_inside_a_tensor_parallel_mlp(dp, tp, zero):
    _compare(WithSwish, lambda m, i: (m(SW_X[i]) ** 2).mean(), _strategy(dp, tp, zero),
             {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()})


# ---- sizes the TP degree does not divide ---------------------------------------------------------------------------------
class Odd(nn.Layer):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 10)
        self.fc1, self.fc2 = nn.Linear(10, 6), nn.Linear(6, 10)
        self.gate, self.up, self.down = nn.Linear(10, 3), nn.Linear(10, 3), nn.Linear(3, 10)
        self.norm, self.head = nn.LayerNorm(10), nn.Linear(10, 6)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.fc2(F.relu(self.fc1(h)))
        h = h + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.head(self.norm(h))


ODD = [(_R.integers(0, 6, (3, 5)), _R.integers(0, 6, (3, 5))) for _ in range(3)]
ODD_PLAN = {"emb": ap.VocabParallelEmbedding(), "fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel(),
            "gate": ap.ColWiseParallel(), "up": ap.ColWiseParallel(), "down": ap.RowWiseParallel(),
            "head": ap.ColWiseParallel()}


def _adamw_clip(ps):
    return paddle.optimizer.AdamW(1e-2, parameters=ps, epsilon=1e-4, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5))


@pytest.mark.parametrize("layout", ["tp4", "tp4-sp", "dp4-zero1", "dp4-zero2", "dp4-zero3", "dp2-tp2-zero3"])
def test_sizes_the_degree_does_not_divide(layout):
    s = {"tp4": _strategy(tp=4), "tp4-sp": _strategy(tp=4, sp=True), "dp4-zero1": _strategy(4, zero=1),
         "dp4-zero2": _strategy(4, zero=2), "dp4-zero3": _strategy(4, zero=3),
         "dp2-tp2-zero3": _strategy(2, 2, zero=3)}[layout]
    loss_of = lambda m, i: F.cross_entropy(m(paddle.to_tensor(ODD[i][0])), paddle.to_tensor(ODD[i][1]))  # noqa: E731
    _compare(Odd, loss_of, s, ODD_PLAN if "tp" in layout else None, make_opt=_adamw_clip)


# ---- optimizer forms combined ------------------------------------------------------------------------------------------
def _warm_cosine():
    return paddle.optimizer.lr.LinearWarmup(paddle.optimizer.lr.CosineAnnealingDecay(0.02, T_max=4), 2, 0.0, 0.02)


def _groups(ps):
    ps = list(ps)
    return paddle.optimizer.AdamW(
        learning_rate=_warm_cosine(), weight_decay=0.1, epsilon=1e-4, grad_clip=paddle.nn.ClipGradByNorm(0.05),
        parameters=[{"params": [p for p in ps if p.ndim >= 2], "learning_rate": 0.5},
                    {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}])


def _decay_fun(ps):
    ps = list(ps)
    decayed = {p.name for p in ps if p.ndim >= 2}
    return paddle.optimizer.AdamW(learning_rate=_warm_cosine(), parameters=ps, weight_decay=0.3, epsilon=1e-4,
                                  apply_decay_param_fun=lambda n: n in decayed, multi_precision=True,
                                  grad_clip=paddle.nn.ClipGradByValue(0.01))


def _nesterov(ps):
    return paddle.optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=ps, use_nesterov=True,
                                     weight_decay=paddle.regularizer.L2Decay(0.01),
                                     grad_clip=paddle.nn.ClipGradByGlobalNorm(0.1))


OPTS = {"groups": (_groups, None), "decay_fun": (_decay_fun, None), "nesterov_set_lr": (_nesterov, {2: 0.05})}


def _gpt_loss(m, i):
    ids, labels = batch(i)
    return F.cross_entropy(m(paddle.to_tensor(ids)), paddle.to_tensor(labels)).mean()


@pytest.mark.parametrize("form", sorted(OPTS))
@pytest.mark.parametrize("layout", ["dp2-tp2-zero3", "dp2-tp2-zero1-sp"])
def test_optimizer_forms_combined(form, layout):
    make_opt, lr_at = OPTS[form]
    s = _strategy(2, 2, zero=3) if layout == "dp2-tp2-zero3" else _strategy(2, 2, zero=1, sp=True)
    want = _compare(lambda: build("gpt"), _gpt_loss, s, tp_plan("gpt"), make_opt=make_opt, steps=4, lr_at=lr_at)
    assert len(set(np.round(want, 5))) == 4         # every step moved the loss


# ---- a head added after parallelize ---------------------------------------------------------------------------------------
class Body(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def _with_new_head():
    paddle.seed(0)
    m = Body()
    paddle.seed(1)
    m.fc2 = nn.Linear(8, 5)
    return m


HEAD_X = [_x((8, 8), i) for i in range(3)]


@pytest.mark.parametrize("dp,tp", [(4, 1), (2, 2)])
def test_a_head_added_after_parallelize_trains_like_one_process(dp, tp):
    """Fine-tuning: ``model.fc2 = nn.Linear(8, 5)`` after ``ap.parallelize`` (its parameters stay plain), then an
    optimizer over ``model.parameters()``. (On 2 launched gloo ranks the same program also equals one process.)"""
    ref = _with_new_head()
    want, _ = _run(ref, paddle.optimizer.AdamW(0.05, parameters=ref.parameters()),
                   lambda m, i: (m(HEAD_X[i]) ** 2).mean(), 3)
    with ap.simulate(world_size=4):
        paddle.seed(0)
        m = Body()
        kw = {"tp_plan": {"fc1": ap.ColWiseParallel()}} if tp > 1 else {}
        m, _ = ap.parallelize(m, None, strategy=_strategy(dp, tp), **kw)
        paddle.seed(1)
        m.fc2 = nn.Linear(8, 5)
        assert not ap.is_dist(m.fc2.weight)
        opt = ap.shard_optimizer(paddle.optimizer.AdamW(0.05, parameters=m.parameters()))
        got, _ = _run(m, opt, lambda m, i: (m(HEAD_X[i]) ** 2).mean(), 3)
        params = {n: _full(p) for n, p in m.named_parameters()}
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(params[n], p.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)
