"""paddle's own transformer layers under ``ap.parallelize``, against one process: ``nn.Transformer`` (encoder-
decoder, causal target mask from ``generate_square_subsequent_mask``) trained 3 AdamW steps under DP 4, a
tp_plan naming self / cross attention and the FFN (TP 4, TP 4 + SP, DP 2 x TP 2 with ZeRO-3) and the default plan
found by structure; ``nn.MultiHeadAttention(need_weights=True)`` with other key / value sizes and bool, float and int
masks (its attention weights enter the loss); ``nn.TransformerDecoder`` decoding greedily with its cache
(``gen_cache`` then one token per call) under TP 4 and DP 2 x TP 2, equal to one process's tokens and logits
and to the full-sequence forward."""
import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

import autoparallel as ap

D, V = 16, 32


def _styles(prefixes, ffn):
    out = {}
    for p in prefixes:
        out.update({f"{p}.q_proj": ap.ColWiseParallel(), f"{p}.k_proj": ap.ColWiseParallel(),
                    f"{p}.v_proj": ap.ColWiseParallel(), f"{p}.out_proj": ap.RowWiseParallel()})
    if ffn:
        out.update({f"{ffn}.linear1": ap.ColWiseParallel(), f"{ffn}.linear2": ap.RowWiseParallel()})
    return out


def _strategy(dp=1, tp=1, zero=0, sp=False):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    s.sequence_parallel.enable = sp
    if zero:
        s.sharding.enable, s.sharding.stage = True, zero
    return s


def _full(t):
    return t.full().numpy() if hasattr(t, "full") else t.numpy()


def _compare(build, loss_of, strategy, plan=None, make_opt=None, steps=3, rtol=1e-4, atol=3e-5):
    make_opt = make_opt or (lambda ps: paddle.optimizer.AdamW(1e-2, parameters=ps, epsilon=1e-4))
    paddle.seed(0)
    ref = build()
    want, opt = [], make_opt(ref.parameters())
    for i in range(steps):
        loss = loss_of(ref, i)
        loss.backward()
        opt.step()
        opt.clear_grad()
        want.append(float(loss))
    paddle.seed(0)
    with ap.simulate(world_size=4):
        m = build()
        kw = {"tp_plan": plan} if plan is not None else {}
        m, opt = ap.parallelize(m, make_opt(m.parameters()), strategy=strategy, **kw)
        got = []
        for i in range(steps):
            loss = loss_of(m, i)
            loss.backward()
            opt.step()
            opt.clear_grad()
            got.append(float(loss))
        params = {n: _full(p) for n, p in m.named_parameters()}
        split = sum(any(not isinstance(q, ap.Replicate) for q in p.placements) for p in m.parameters())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(params[n], p.numpy(), rtol=rtol, atol=atol, err_msg=n)
    return split


class Seq2Seq(nn.Layer):
    def __init__(self):
        super().__init__()
        self.src, self.tgt = nn.Embedding(V, D), nn.Embedding(V, D)
        self.tr = nn.Transformer(D, 4, 1, 1, 32, dropout=0.0)
        self.head = nn.Linear(D, V)

    def forward(self, s, t):
        mask = self.tr.generate_square_subsequent_mask(t.shape[1])
        return self.head(self.tr(self.src(s), self.tgt(t), tgt_mask=mask))


RNG = np.random.default_rng(0)
S2S = [(RNG.integers(0, V, (4, 6)), RNG.integers(0, V, (4, 5)), RNG.integers(0, V, (4, 5))) for _ in range(3)]


def _s2s_loss(m, i):
    s, t, y = (paddle.to_tensor(a) for a in S2S[i])
    return F.cross_entropy(m(s, t), y).mean()


S2S_PLAN = {"tp4": ("tp", 1, 4, 0), "dp2-tp2-zero3": ("tp", 2, 2, 3), "dp4": (None, 4, 1, 0),
            "dp2-tp2-default-plan": ("default", 2, 2, 0), "tp4-sp": ("tp", 1, 4, 0)}


@pytest.mark.parametrize("layout", sorted(S2S_PLAN))
def test_nn_transformer_encoder_decoder(layout):
    kind, dp, tp, zero = S2S_PLAN[layout]
    plan = None
    if kind == "tp":
        plan = _styles(["*.self_attn", "*.cross_attn"], "*")
    split = _compare(Seq2Seq, _s2s_loss, _strategy(dp, tp, zero, sp=layout.endswith("-sp")), plan)
    if tp > 1:     # 2 encoder + 3 decoder attention blocks' q/k/v/out weights and biases, 2 FFNs' 4 tensors each
        assert split >= (2 * 4 + 4) if kind == "tp" else split > 0


class MHA(nn.Layer):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiHeadAttention(D, 4, need_weights=True, kdim=8, vdim=12)
        self.fc = nn.Linear(D, 3)

    def forward(self, q, k, v, mask):
        out, weights = self.attn(q, k, v, attn_mask=mask)
        return self.fc(out).sum() + (weights * weights).sum()


def _x(shape, seed):
    return paddle.to_tensor(np.random.default_rng(seed).standard_normal(shape).astype("float32"))


MASKS = {"bool": lambda r: paddle.to_tensor(r.random((4, 1, 5, 7)) > 0.3),
         "float": lambda r: paddle.to_tensor(np.where(r.random((4, 4, 5, 7)) > 0.3, 0.0, -1e4).astype("float32")),
         "int": lambda r: paddle.to_tensor((r.random((5, 7)) > 0.3).astype("int64"))}


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_multi_head_attention_returning_its_weights(mask):
    q, k, v = _x((4, 5, D), 0), _x((4, 7, 8), 1), _x((4, 7, 12), 2)
    m = MASKS[mask](np.random.default_rng(3))
    sgd = lambda ps: paddle.optimizer.SGD(0.05, parameters=ps)  # noqa: E731   (k_proj's bias has no gradient)
    _compare(MHA, lambda model, i: model(q, k, v, m), _strategy(2, 2), _styles(["attn"], None), make_opt=sgd)


class Decoder(nn.Layer):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, 4, 32, dropout=0.0), 2)
        self.head = nn.Linear(D, V)

    def forward(self, t, memory, mask=None, cache=None):
        out = self.dec(self.emb(t), memory, tgt_mask=mask, cache=cache)
        if cache is None:
            return self.head(out)
        out, cache = out
        return self.head(out), cache


MEMORY = _x((2, 5, D), 3)


def _greedy(m, steps=4):
    tokens = paddle.to_tensor(np.array([[1], [2]]))
    cache = m.dec.gen_cache(MEMORY)
    logits = []
    for _ in range(steps):
        lg, cache = m(tokens[:, -1:], MEMORY, None, cache)
        logits.append(_full(lg))
        nxt = paddle.argmax(lg[:, -1], axis=-1, keepdim=True)
        tokens = paddle.concat([tokens, nxt.astype(tokens.dtype)], axis=1)
    return _full(tokens), np.concatenate(logits, 1)


def _whole(m, tokens):
    t = paddle.to_tensor(tokens)
    mask = paddle.triu(paddle.full([t.shape[1]] * 2, -1e9), 1)
    return _full(m(t, MEMORY, mask))


@pytest.mark.parametrize("dp,tp", [(1, 4), (2, 2)])
def test_transformer_decoder_greedy_decoding_with_its_cache(dp, tp):
    paddle.seed(0)
    ref = Decoder()
    ref.eval()
    want_tokens, want_logits = _greedy(ref)
    assert np.abs(_whole(ref, want_tokens[:, :-1]) - want_logits).max() < 1e-5     # the cache is exact
    paddle.seed(0)
    with ap.simulate(world_size=4):
        m = Decoder()
        m, _ = ap.parallelize(m, None, strategy=_strategy(dp, tp), tp_plan=_styles(
            ["dec.layers.*.self_attn", "dec.layers.*.cross_attn"], "dec.layers.*"))
        m.eval()
        tokens, logits = _greedy(m)
        whole = _whole(m, want_tokens[:, :-1])
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(whole, want_logits, rtol=1e-4, atol=1e-5)
