"""Weight sharing beyond tied embeddings, against one process: one block object applied N times (ALBERT-style,
``nn.LayerList([block] * 3)`` of paddle's ``TransformerEncoderLayer``) under DP x TP with recompute, ZeRO-3 with
recompute, TP + SP and DP x TP x ZeRO-2; a tied autoencoder (the encoder's weight reused transposed by the
decoder) under DP x TP; and the shared block split into pipeline stages (1F1B, FThenB, VPP; in one process and
on 2 simulated ranks). The pipeline split swapped each list position's forward on the block object, so the one
object kept only the last position's proxy and the stages ran the wrong blocks (every parameter off after one
step, no error); positions now take the object's calls in order. A shared block with data parallelism inside
the stages stays refused by name."""
import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.parallel.pipeline.auto_split import model_output
from autoparallel.parallel.pipeline.runtime import apply_pp

D, VOCAB = 16, 32
RNG = np.random.default_rng(0)
DATA = [(RNG.integers(0, VOCAB, (4, 6)), RNG.integers(0, VOCAB, (4, 6))) for _ in range(3)]
ATTN_PLAN = {"layers.*.self_attn.q_proj": "col", "layers.*.self_attn.k_proj": "col",
             "layers.*.self_attn.v_proj": "col", "layers.*.self_attn.out_proj": "row",
             "layers.*.linear1": "col", "layers.*.linear2": "row"}


def _styles(plan):
    return {k: ap.ColWiseParallel() if v == "col" else ap.RowWiseParallel() for k, v in plan.items()}


class Albert(nn.Layer):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        block = nn.TransformerEncoderLayer(D, 4, 32, dropout=0.0, normalize_before=True)
        self.layers = nn.LayerList([block] * 3)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class TiedAutoencoder(nn.Layer):
    def __init__(self):
        super().__init__()
        self.enc, self.mid = nn.Linear(12, 8), nn.Linear(8, 8)
        self.dbias = self.create_parameter([12], is_bias=True)

    def forward(self, x):
        h = self.mid(F.gelu(self.enc(x)))
        return paddle.matmul(h, self.enc.weight, transpose_y=True) + self.dbias


XS = [np.random.default_rng(i).standard_normal((8, 12)).astype("float32") for i in range(3)]
MODELS = {
    "albert": (Albert, lambda m, i: F.cross_entropy(m(paddle.to_tensor(DATA[i][0])), paddle.to_tensor(DATA[i][1]))),
    "autoencoder": (TiedAutoencoder, lambda m, i: ((m(paddle.to_tensor(XS[i])) - paddle.to_tensor(XS[i])) ** 2).mean()),
}


def _train(model, opt, loss_of):
    losses = []
    for i in range(3):
        loss = loss_of(model, i)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def _one_process(name):
    build, loss_of = MODELS[name]
    paddle.seed(0)
    m = build()
    return _train(m, paddle.optimizer.SGD(0.1, parameters=m.parameters()), loss_of), \
        {n: p.numpy() for n, p in m.named_parameters()}


def _parallel(name, dp, tp, zero=0, sp=False, recompute=False, plan=None):
    build, loss_of = MODELS[name]
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    s.sharding.enable, s.sharding.stage = zero > 0, max(zero, 1)
    s.sequence_parallel.enable, s.recompute.enable = sp, recompute
    paddle.seed(0)
    with ap.simulate(world_size=4):
        m = build()
        kw = {"tp_plan": _styles(plan)} if plan else {}
        m, opt = ap.parallelize(m, paddle.optimizer.SGD(0.1, parameters=m.parameters()), strategy=s, **kw)
        return _train(m, opt, loss_of), {n: p.full().numpy() for n, p in m.named_parameters()}


def _assert_same(got, want, rtol=1e-4, atol=1e-6):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert set(got[1]) == set(want[1])
    for n, v in want[1].items():
        np.testing.assert_allclose(got[1][n], v, rtol=rtol, atol=atol, err_msg=n)


@pytest.mark.parametrize("layout", ["dp2-tp2-recompute", "dp4-zero3-recompute", "tp4-sp", "dp2-tp2-zero2"])
def test_one_block_applied_three_times(layout):
    kw = {"dp2-tp2-recompute": dict(dp=2, tp=2, recompute=True, plan=ATTN_PLAN),
          "dp4-zero3-recompute": dict(dp=4, tp=1, zero=3, recompute=True),
          "tp4-sp": dict(dp=1, tp=4, sp=True, plan=ATTN_PLAN),
          "dp2-tp2-zero2": dict(dp=2, tp=2, zero=2, plan=ATTN_PLAN)}[layout]
    want = _one_process("albert")
    assert len(want[1]) == 1 + 16 + 2           # the embedding, one block (4 projections, 2 FFN, 2 norms), head
    _assert_same(_parallel("albert", **kw), want)


def test_an_encoder_weight_reused_transposed_by_the_decoder():
    want = _one_process("autoencoder")
    _assert_same(_parallel("autoencoder", dp=2, tp=2, plan={"enc": "col", "mid": "row"}), want)


# ---- the shared block split into pipeline stages ------------------------------------------------------------------
class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, hidden_states, attention_mask=None):
        return hidden_states + paddle.tanh(self.fc(hidden_states)) * attention_mask.unsqueeze(-1).astype("float32")


class SharedStack(nn.Layer):
    def __init__(self):
        super().__init__()
        paddle.seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.layers = nn.LayerList([Block()] * 4)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = paddle.ones_like(input_ids)
        h = self.emb(input_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=attention_mask)
        return {"logits": self.head(h)}


def _pp_batches():
    out = []
    for i in range(3):
        ids, labels = DATA[i]
        mask = np.ones_like(ids)
        mask[0, 4:] = 0
        out.append(({"input_ids": paddle.to_tensor(ids), "attention_mask": paddle.to_tensor(mask)}, labels))
    return out


def _pp_reference():
    m = SharedStack()
    opt = paddle.optimizer.SGD(0.5, parameters=m.parameters())
    losses = []
    for inputs, labels in _pp_batches():
        loss = F.cross_entropy(model_output(m(**inputs)), paddle.to_tensor(labels))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: p.numpy() for n, p in m.named_parameters()}


def _pp_strategy(schedule, vpp=1, dp=1):
    s = ap.Strategy()
    s.pipeline_parallel.degree, s.pipeline_parallel.schedule = 2, schedule
    s.pipeline_parallel.micro_batches, s.pipeline_parallel.vpp_degree = 2, vpp
    s.data_parallel.degree = dp
    return s


def _pp_train(pipe, opt):
    losses = []
    for inputs, labels in _pp_batches():
        losses.append(float(pipe.train_batch(inputs, labels)))
        opt.step()
        opt.clear_grad()
    return losses, {n: (p.full().numpy() if hasattr(p, "full") else p.numpy()) for n, p in pipe.named_parameters()}


@pytest.mark.parametrize("schedule,vpp", [("1F1B", 1), ("FThenB", 1), ("VPP", 2)])
def test_a_shared_block_split_into_pipeline_stages_in_one_process(schedule, vpp):
    want = _pp_reference()
    m = SharedStack()
    pipe = apply_pp(m, _pp_strategy(schedule, vpp))
    got = _pp_train(pipe, pipe.wrap_optimizer(paddle.optimizer.SGD(0.5, parameters=m.parameters())))
    _assert_same(got, want, rtol=1e-5)


def test_a_shared_block_split_into_pipeline_stages_on_two_simulated_ranks():
    want = _pp_reference()
    with ap.simulate(world_size=2):
        m = SharedStack()
        pipe, opt = ap.parallelize(m, paddle.optimizer.SGD(0.5, parameters=m.parameters()), strategy=_pp_strategy("1F1B"))
        got = _pp_train(pipe, opt)
    _assert_same(got, want, rtol=1e-5)


def test_a_shared_block_with_data_parallel_stages_is_refused_by_name():
    with ap.simulate(world_size=4):
        m = SharedStack()
        with pytest.raises(NotImplementedError, match="layers.0.fc.weight"):
            ap.parallelize(m, paddle.optimizer.SGD(0.5, parameters=m.parameters()), strategy=_pp_strategy("1F1B", dp=2))
