"""Sample calls of the fused-kernel rules (spmd_rules/fused.py). Paddle 3.3 has no CPU kernel for them, so each is
checked against a python reference of the op written with paddle's primitives (ground truth on the full tensors
and the local op on every rank's shards): the references fix what each input means for the layout (which dims
are per row, per head, per position, contracted), not the kernels' rounding."""
from __future__ import annotations

import numpy as np

from .case import IMPLS, T, add_case, f, ints
from .local_arrays import _paddle


def _np_only(t: T) -> T:
    """Also tried sharded, never Partial (keeps the layout product of a many-input call small)."""
    t.partial = False
    return t


def _w(*shape):
    """A parameter tried only replicated (keeps the layout product of many-input ops small)."""
    t = f(*shape)
    t.shard = False
    return t


# ---- references -------------------------------------------------------------------------------------------------
def _matmul_bias(x, y, bias=None, transpose_x=False, transpose_y=False, name=None):
    out = _paddle().matmul(x, y, transpose_x, transpose_y)
    return out if bias is None else out + bias


def _linear(x, weight, bias=None, transpose_weight=False, name=None):
    return _matmul_bias(x, weight, bias, False, transpose_weight)


def _act(h, act_method):
    paddle = _paddle()
    F = paddle.nn.functional
    if act_method in ("swiglu", "geglu"):
        a, b = paddle.chunk(h, 2, axis=-1)
        return (F.silu(a) if act_method == "swiglu" else F.gelu(a)) * b
    return {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "swish": F.silu, "sigmoid": F.sigmoid,
            "tanh": paddle.tanh, "identity": lambda t: t}[act_method](h)


def _bias_act(x, bias=None, dequant_scales=None, shift=None, smooth=None, act_method="gelu", **_):
    return _act(x if bias is None else x + bias, act_method)


def _rotate(x, neox):
    paddle = _paddle()
    if neox:
        x1, x2 = paddle.chunk(x, 2, axis=-1)
        return paddle.concat([-x2, x1], axis=-1)
    pairs = x.reshape(list(x.shape[:-1]) + [x.shape[-1] // 2, 2])
    return paddle.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)


def _rope_tables(q, sin, cos, position_ids, time_major, base):
    paddle = _paddle()
    s, d = q.shape[0 if time_major else 1], q.shape[-1]
    if sin is None:
        inv = paddle.to_tensor(base ** (-np.arange(0, d, 2) / d), dtype=q.dtype)
        theta = paddle.arange(s, dtype=q.dtype)[:, None] * inv[None, :]
        sin, cos = (paddle.concat([g(theta)] * 2, axis=-1) for g in (paddle.sin, paddle.cos))
    if position_ids is not None:
        sin, cos = (paddle.gather(t.reshape([-1, d]), position_ids.reshape([-1])).reshape(
            list(position_ids.shape) + [1, d]) for t in (sin, cos))
        return (t.transpose([1, 0, 2, 3]) if time_major else t for t in (sin, cos))
    shape = [s, 1, 1, d] if time_major else [1, s, 1, d]
    return sin.reshape(shape), cos.reshape(shape)


def _rope(q, k=None, v=None, sin=None, cos=None, position_ids=None, use_neox_rotary_style=True, time_major=False,
          rotary_emb_base=10000.0):
    sin, cos = _rope_tables(q, sin, cos, position_ids, time_major, rotary_emb_base)
    return tuple(None if t is None else t * cos + _rotate(t, use_neox_rotary_style) * sin for t in (q, k, v))


def _ln(x, scale, bias, eps):
    return _paddle().nn.functional.layer_norm(x, x.shape[-1:], scale, bias, eps)


def _ffn(x, linear1_weight, linear2_weight, linear1_bias=None, linear2_bias=None, ln1_scale=None, ln1_bias=None,
         ln2_scale=None, ln2_bias=None, dropout1_rate=0.5, dropout2_rate=0.5, activation="relu", ln1_epsilon=1e-5,
         ln2_epsilon=1e-5, pre_layer_norm=False, training=True, mode="upscale_in_train", ring_id=-1,
         add_residual=True, name=None):
    F = _paddle().nn.functional
    h = _ln(x, ln1_scale, ln1_bias, ln1_epsilon) if pre_layer_norm else x
    h = F.linear(_act(F.linear(h, linear1_weight, linear1_bias), activation), linear2_weight, linear2_bias)
    h = x + h if add_residual else h
    return h if pre_layer_norm else _ln(h, ln2_scale, ln2_bias, ln2_epsilon)


def _mha(x, qkv_weight, linear_weight, pre_layer_norm=False, pre_ln_scale=None, pre_ln_bias=None, ln_scale=None,
         ln_bias=None, pre_ln_epsilon=1e-5, qkv_bias=None, linear_bias=None, cache_kv=None, attn_mask=None,
         dropout_rate=0.5, attn_dropout_rate=0.5, ln_epsilon=1e-5, training=True, mode="upscale_in_train",
         ring_id=-1, add_residual=True, num_heads=-1, transpose_qkv_wb=False, name=None):
    paddle = _paddle()
    F = paddle.nn.functional
    b, s, e = x.shape
    _, h, dh, _ = qkv_weight.shape
    y = _ln(x, pre_ln_scale, pre_ln_bias, pre_ln_epsilon) if pre_layer_norm else x
    qkv = paddle.matmul(y, qkv_weight.reshape([3 * h * dh, e]), transpose_y=True)
    if qkv_bias is not None:
        qkv = qkv + qkv_bias.reshape([-1])
    q, k, v = paddle.unbind(qkv.reshape([b, s, 3, h, dh]).transpose([2, 0, 3, 1, 4]), 0)
    scores = paddle.matmul(q, k, transpose_y=True) / float(np.sqrt(dh))
    if attn_mask is not None:
        scores = scores + attn_mask
    out = paddle.matmul(F.softmax(scores, -1), v).transpose([0, 2, 1, 3]).reshape([b, s, h * dh])
    out = F.linear(out, linear_weight, linear_bias)
    out = x + out if add_residual else out
    return out if pre_layer_norm else _ln(out, ln_scale, ln_bias, ln_epsilon)


def _attend(q, k, v, mask, scale):
    """q [h, sq, d], k/v [hk, sk, d] (grouped heads repeated), mask [h or 1, sq, sk] True = masked."""
    paddle = _paddle()
    if q.shape[0] == 0 or q.shape[1] == 0:                  # an empty shard (more ranks than heads)
        return paddle.zeros([q.shape[0], q.shape[1], v.shape[2]], q.dtype)
    g = q.shape[0] // k.shape[0]
    k, v = (paddle.repeat_interleave(t, g, axis=0) for t in (k, v))
    scores = paddle.matmul(q, k, transpose_y=True) * scale
    scores = paddle.where(mask, paddle.full_like(scores, -1e30), scores) if mask is not None else scores
    return paddle.matmul(paddle.nn.functional.softmax(scores, -1), v)


def _unpadded(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, dropout=0.0,
              causal=False, return_softmax=False, fixed_seed_offset=None, rng_name="", training=True, name=None):
    paddle = _paddle()
    cq, ck = (np.asarray(c.numpy()).tolist() for c in (cu_seqlens_q, cu_seqlens_k))
    outs = []
    for i in range(len(cq) - 1):
        q, k, v = (t[a:b].transpose([1, 0, 2]) for t, (a, b) in
                   ((query, cq[i:i + 2]), (key, ck[i:i + 2]), (value, ck[i:i + 2])))
        mask = None
        if causal:
            mask = paddle.to_tensor(np.triu(np.ones((q.shape[1], k.shape[1]), bool), 1))[None]
        outs.append(_attend(q, k, v, mask, scale).transpose([1, 0, 2]))
    return paddle.concat(outs, 0), None


def _flashmask(query, key, value, startend_row_indices=None, *, dropout=0.0, causal=False, window_size=None,
               return_softmax_lse=False, return_seed_offset=False, fixed_seed_offset=None, rng_name="",
               training=True, name=None, softmax_scale=None, block_mask=None):
    paddle = _paddle()
    b, s, h, d = query.shape
    scale = softmax_scale or 1.0 / float(np.sqrt(d))
    rows = paddle.arange(s)[:, None]
    outs = []
    for i in range(b):
        mask = None
        if startend_row_indices is not None:
            idx = startend_row_indices[i].astype("int64")            # [h or 1, s, 1 or 2]
            mask = rows[None] >= idx[:, None, :, 0]                  # LT start: rows at or below it masked
            if idx.shape[-1] == 2:
                mask = mask | (rows[None] < idx[:, None, :, 1])      # UT end (non-causal)
        if causal:
            tri = paddle.to_tensor(np.triu(np.ones((s, s), bool), 1))[None]
            mask = tri if mask is None else mask | tri
        q, k, v = (t[i].transpose([1, 0, 2]) for t in (query, key, value))
        outs.append(_attend(q, k, v, mask, scale).transpose([1, 0, 2]))
    return paddle.stack(outs, 0) if outs else paddle.zeros([0, s, h, value.shape[3]], query.dtype)


def _causal_softmax(x):
    paddle = _paddle()
    s = x.shape[-1]
    tri = paddle.to_tensor(np.triu(np.ones((s, s), bool), 1))
    return paddle.nn.functional.softmax(paddle.where(tri, paddle.full_like(x, -1e30), x), -1)


# ---- sample calls -----------------------------------------------------------------------------------------------
def cases_fused():
    IMPLS.update(fused_matmul_bias=_matmul_bias, fused_linear=_linear, fused_bias_act=_bias_act,
                 fused_rotary_position_embedding=_rope, fused_feedforward=_ffn, fused_multi_head_attention=_mha,
                 flash_attn_unpadded=_unpadded, flashmask_attention=_flashmask,
                 softmax_mask_fuse_upper_triangle=_causal_softmax)
    add_case("fused_linear", f(2, 3, 4), f(4, 6), f(6))
    add_case("fused_linear", f(3, 4), f(6, 4), f(6), transpose_weight=True, label="transposed")
    add_case("fused_matmul_bias", f(4, 3), f(6, 4), f(6), transpose_x=True, transpose_y=True, label="both-t")
    add_case("fused_matmul_bias", f(3, 4), f(4, 6), label="no-bias")
    add_case("fused_bias_act", f(3, 4, 6), f(6), act_method="gelu")
    add_case("fused_bias_act", f(4, 6), f(6), act_method="swiglu", label="swiglu")
    add_case("fused_bias_act", f(4, 6), act_method="relu", label="no-bias")
    q, k = f(2, 4, 4, 6), f(2, 4, 2, 6)
    add_case("fused_rotary_position_embedding", q, _np_only(k), None, _np_only(f(1, 4, 1, 6)),
             _np_only(f(1, 4, 1, 6)), label="sincos-gqa")
    add_case("fused_rotary_position_embedding", f(4, 2, 2, 6), None, None, f(4, 6), f(4, 6), time_major=True,
             use_neox_rotary_style=False, label="time-major-2d-tables")
    add_case("fused_rotary_position_embedding", f(2, 4, 2, 6), label="computed-tables")
    add_case("fused_rotary_position_embedding", f(2, 3, 2, 6), None, None, _w(1, 5, 1, 6), _w(1, 5, 1, 6),
             ints(5, 2, 3), label="position-ids")
    add_case("fused_feedforward", f(2, 3, 4), _w(4, 8), _w(8, 4), _w(8), _w(4), dropout1_rate=0.0,
             dropout2_rate=0.0, label="post-ln")
    add_case("fused_feedforward", f(3, 4), _w(4, 8), _w(8, 4), ln1_scale=_w(4), ln1_bias=_w(4), dropout1_rate=0.0,
             dropout2_rate=0.0, pre_layer_norm=True, activation="gelu", label="pre-ln")
    add_case("fused_multi_head_attention", f(2, 3, 4), _w(3, 2, 2, 4), _w(4, 4), qkv_bias=_w(3, 2, 2),
             attn_mask=f(2, 1, 3, 3), dropout_rate=0.0, attn_dropout_rate=0.0, label="mask")
    cu = T(np.array([0, 2, 5], np.int32), shard=False)
    add_case("flash_attn_unpadded", f(5, 4, 3), f(5, 2, 3), f(5, 2, 3), cu, cu, 3, 3, 0.5, causal=True,
             label="gqa-causal")
    starts = T(np.array([[[[3], [4], [4], [4]]], [[[2], [2], [4], [4]]]], np.int32))
    add_case("flashmask_attention", f(2, 4, 2, 3), _np_only(f(2, 4, 2, 3)), _np_only(f(2, 4, 2, 3)), starts,
             causal=True, label="causal-lts")
    add_case("flashmask_attention", f(2, 4, 4, 3), _np_only(f(2, 4, 2, 3)), f(2, 4, 2, 3), label="no-mask-gqa")
    add_case("softmax_mask_fuse", f(2, 2, 3, 4), f(2, 1, 3, 4))
    add_case("softmax_mask_fuse_upper_triangle", f(2, 2, 4, 4))
    # paddle's unbatched form of scaled_dot_product_attention ([seq, heads, dim]; the mask broadcasts to
    # [1, heads, q_seq, k_seq])
    add_case("scaled_dot_product_attention", f(5, 6, 3), _np_only(f(7, 6, 3)), f(7, 6, 3), f(6, 5, 7),
             label="unbatched-mask")
