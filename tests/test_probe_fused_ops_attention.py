"""Attention as users write it, on distributed tensors in the simulated world, against one process (values and
input gradients): ``F.scaled_dot_product_attention`` with every argument (bool / float masks, ``is_causal``,
``dropout_p`` in training and eval, ``scale``) in the layouts models give it (batch split, heads split under
tensor parallelism, sequence split, replicated, and a 2x2 mesh), ``flash_attention`` / ``flash_attn_qkvpacked``
(paddle's CPU math path), the ops of hand-written attention code, and the typed error of the GPU-only entry
points on CPU."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap

B0, S1, H2, R = ap.Shard(0), ap.Shard(1), ap.Shard(2), ap.Replicate()


def _arrays(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype("float32") if not isinstance(s, np.ndarray) else s for s in shapes]


def _grads_of(outs, tensors):
    loss = 0
    for o in outs:
        w = paddle.arange(int(np.prod(o.shape)), dtype="float32").reshape(o.shape) / 50.0
        loss = loss + (o * w.sin()).sum()
    loss.backward()
    return [t.grad if t.grad is not None else paddle.zeros(t.shape) for t in tensors if not t.stop_gradient]


def _np(t):
    return (t.full() if hasattr(t, "full") else t).numpy()


def _one(fn, arrays, seed=None):
    if seed is not None:
        paddle.seed(seed)
    ts = [paddle.to_tensor(a) for a in arrays]
    for t in ts:
        t.stop_gradient = t.dtype != paddle.float32
    outs = fn(*ts)
    outs = [o for o in (outs if isinstance(outs, (tuple, list)) else [outs]) if o is not None]
    return [_np(o) for o in outs] + [_np(g) for g in _grads_of(outs, ts)]


def _sim(fn, arrays, places, world=2, seed=None):
    with ap.simulate(world_size=world):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]) if world == 4 else \
            ap.ProcessMesh([0, 1], dim_names=["x"])
        if seed is not None:
            paddle.seed(seed)
        ts = []
        for a, p in zip(arrays, places):
            t = ap.shard_tensor(paddle.to_tensor(a), mesh, p if isinstance(p, list) else [p])
            t.stop_gradient = a.dtype != np.float32
            ts.append(t)
        outs = fn(*ts)
        outs = [o for o in (outs if isinstance(outs, (tuple, list)) else [outs]) if o is not None]
        return [_np(o) for o in outs] + [_np(g) for g in _grads_of(outs, ts)]


def _same(got, want, tol=1e-5):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


def _sdpa(**kw):
    def fn(q, k, v, *mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None, **kw)
    return fn


QKV = _arrays((4, 6, 4, 8), (4, 6, 2, 8), (4, 6, 2, 8))        # grouped-query: 4 query heads, 2 kv heads
BOOL = (np.random.default_rng(1).random((4, 1, 6, 6)) > 0.3)
FLOAT = _arrays((1, 4, 6, 6), seed=2)[0]


@pytest.mark.parametrize("place", [B0, S1, H2, R], ids=["batch", "seq", "heads", "R"])
def test_sdpa_masks_and_causal_equal_one_process(place):
    """No mask, a bool mask split with the batch, a float per-head mask, causal (the sequence is then gathered),
    and ``scale``: values and q/k/v gradients."""
    bmask = B0 if place is B0 else R
    fmask = ap.Shard(1) if place is H2 else R
    for fn, extra, mp in ((_sdpa(), [], []), (_sdpa(is_causal=True), [], []), (_sdpa(scale=0.2), [], []),
                          (_sdpa(), [BOOL], [bmask]), (_sdpa(), [FLOAT], [fmask])):
        _same(_sim(fn, QKV + extra, [place] * 3 + mp), _one(fn, QKV + extra))


def test_sdpa_on_a_2x2_mesh_batch_and_heads():
    fn = _sdpa(is_causal=True)
    _same(_sim(fn, QKV, [[B0, H2]] * 3, world=4), _one(fn, QKV))
    fn = _sdpa(dropout_p=0.3)
    _same(_sim(fn, QKV, [[B0, S1]] * 3, world=4, seed=2), _one(fn, QKV, seed=2))


@pytest.mark.parametrize("place,causal", [(B0, False), (H2, True), (S1, False)], ids=["batch", "heads-causal", "seq"])
def test_sdpa_dropout_in_training_equals_one_process_for_the_same_seed(place, causal):
    """One keep-mask drawn for the global [batch, heads, q, k] shape: the single-process values and gradients;
    negative control: another seed differs. ``training=False`` drops nothing."""
    fn = _sdpa(dropout_p=0.3, is_causal=causal)
    got = _sim(fn, QKV, [place] * 3, seed=7)
    _same(got, _one(fn, QKV, seed=7))
    assert not np.allclose(got[0], _one(fn, QKV, seed=8)[0])
    ev = _sdpa(dropout_p=0.3, training=False)
    _same(_sim(ev, QKV, [place] * 3), _one(_sdpa(), QKV))


def test_sdpa_unbatched_form_equals_one_process():
    """[seq, heads, dim] inputs (paddle adds a batch of one): heads or sequence split, a [heads, q, k] mask, and
    dropout in training (the keep-mask of the batch of one)."""
    q, k, v, m = _arrays((6, 4, 8), (6, 4, 8), (6, 4, 8), (4, 6, 6), seed=11)
    for place, mp in ((ap.Shard(1), B0), (B0, R)):
        for fn, seed in ((_sdpa(), None), (_sdpa(dropout_p=0.3), 7)):
            _same(_sim(fn, [q, k, v, m], [place] * 3 + [mp], seed=seed), _one(fn, [q, k, v, m], seed=seed))


def test_flash_attention_cpu_path_and_qkvpacked():
    """``flash_attention`` (dropout in training too) and ``flash_attn_qkvpacked`` on paddle's CPU math path."""
    fa = paddle.nn.functional.flash_attention
    q, k, v = _arrays((4, 6, 4, 8), (4, 6, 4, 8), (4, 6, 4, 8), seed=3)
    for fn, seed in ((lambda q, k, v: fa.flash_attention(q, k, v, causal=True)[0], None),
                     (lambda q, k, v: fa.flash_attention(q, k, v, dropout=0.25)[0], 5)):
        for place in (B0, H2):
            _same(_sim(fn, [q, k, v], [place] * 3, seed=seed), _one(fn, [q, k, v], seed=seed))
    packed = np.stack([q, k, v], axis=2)                      # [b, s, 3, heads, dim]
    for fn, seed in ((lambda t: fa.flash_attn_qkvpacked(t, causal=True)[0], None),
                     (lambda t: F.flash_attn_qkvpacked(t, dropout=0.2)[0], 4)):      # the F name was guarded
        for place in (B0, ap.Shard(3)):
            _same(_sim(fn, [packed], [place], seed=seed), _one(fn, [packed], seed=seed))


def _attention_code(x, m):
    """Hand-written attention scores: a causal mask from the shapes, a broadcast bool mask, softmax in float64."""
    s = x.shape[-1]
    x = x.masked_fill(paddle.triu(paddle.ones([s, s], dtype="bool"), 1), -1e4)
    x = paddle.where(m, x, paddle.full_like(x, -1e4))
    p = F.softmax(x, axis=-1, dtype="float64").astype("float32")
    return F.pad(p, [0, 0, 1, 2], value=0.5, data_format="NCHW"), paddle.tril(p, -1) + paddle.triu(p, 2)


@pytest.mark.parametrize("place", [B0, ap.Shard(1), ap.Shard(2)], ids=["batch", "heads", "seq"])
def test_attention_code_ops_equal_one_process(place):
    """masked_fill / triu / where / softmax(dtype=) / F.pad on a (possibly split) sequence dim / tril; and a
    three-operand einsum."""
    x, = _arrays((4, 2, 6, 6), seed=4)
    m = np.random.default_rng(5).random((4, 1, 1, 6)) > 0.2
    _same(_sim(_attention_code, [x, m], [place, B0 if place is B0 else R]), _one(_attention_code, [x, m]))
    ein = lambda a, b, c: paddle.einsum("bhqd,bhkd,bhkd->bhq", a, b, c)      # noqa: E731
    abc = _arrays((4, 2, 6, 3), (4, 2, 5, 3), (4, 2, 5, 3), seed=6)
    _same(_sim(ein, abc, [place] * 3), _one(ein, abc))


def test_gpu_only_attention_entry_points_raise_a_typed_error_on_cpu():
    fa = paddle.nn.functional.flash_attention
    q, = _arrays((8, 4, 8))
    cu = np.array([0, 3, 8], np.int32)
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        d = ap.shard_tensor(paddle.to_tensor(q), mesh, [ap.Shard(1)])
        c = ap.shard_tensor(paddle.to_tensor(cu), mesh, [R])
        with pytest.raises(NotImplementedError, match="flash_attn_unpadded has no CPU kernel.*'cpu'"):
            fa.flash_attn_unpadded(d, d, d, c, c, 5, 5, 0.3)
        q4 = ap.shard_tensor(paddle.to_tensor(q.reshape(2, 4, 4, 8)), mesh, [B0])
        with pytest.raises(NotImplementedError, match="flashmask_attention has no CPU kernel"):
            F.flashmask_attention(q4, q4, q4, causal=True)


@pytest.mark.parametrize("place", [B0, S1], ids=["batch", "seq"])
def test_multi_head_attention_layers_with_dropout_equal_one_process(place):
    """``nn.MultiHeadAttention`` and ``nn.TransformerEncoderLayer`` (attention-probability dropout in training, a
    bool mask): paddle's own layers on distributed inputs, the single-process values for the same seeds."""
    x, = _arrays((4, 6, 8), seed=9)
    mask = np.random.default_rng(10).random((4, 1, 6, 6)) > 0.2

    def layer(kind):
        paddle.seed(1)
        m = paddle.nn.MultiHeadAttention(8, 2, dropout=0.2) if kind == "mha" else \
            paddle.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.2)
        return lambda t, mk: m(t, attn_mask=mk) if kind == "mha" else m(t, src_mask=mk)

    for kind in ("mha", "encoder"):
        want = _one(layer(kind), [x, mask], seed=5)
        _same(_sim(layer(kind), [x, mask], [place, B0 if place is B0 else R], seed=5), want)


def test_incubate_softmax_mask_fuse():
    """``paddle.incubate.softmax_mask_fuse(x, mask)`` (CPU kernel) on batch / heads / query rows against one
    process; the causal ``softmax_mask_fuse_upper_triangle`` (GPU only) refused on CPU by name; the rest of
    ``paddle.incubate`` guarded."""
    x, m = _arrays((4, 2, 6, 6), (4, 1, 6, 6), seed=12)
    fn = paddle.incubate.softmax_mask_fuse
    for place, mp in ((B0, B0), (ap.Shard(1), R), (ap.Shard(2), ap.Shard(2))):
        _same(_sim(fn, [x, m], [place, mp]), _one(fn, [x, m]))
    with ap.simulate(world_size=2):
        d = ap.shard_tensor(paddle.to_tensor(x), ap.ProcessMesh([0, 1], dim_names=["x"]), [B0])
        with pytest.raises(NotImplementedError, match="softmax_mask_fuse_upper_triangle has no CPU kernel"):
            paddle.incubate.softmax_mask_fuse_upper_triangle(d)
        with pytest.raises(NotImplementedError, match="paddle.incubate.segment_sum has no spmd rule"):
            paddle.incubate.segment_sum(d, paddle.zeros([4], dtype="int32"))
