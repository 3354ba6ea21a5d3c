"""Fused ops users call directly: ``paddle.incubate.nn.functional`` kernels and the varlen / mask attention
entry points. Paddle 3.3 has no CPU kernel for any of them; the rules hold for GPU, and on CPU the runtime
refuses the call with a typed error (``composites_fused``). Each rule is checked against a python reference of
the op (``spmd_rules/validation/samples_fused.py``).

* ``fused_linear(x, w, b, transpose_weight)``, ``fused_matmul_bias(x, y, b, transpose_x, transpose_y)``: the
  matmul labels; the bias follows the output's last dim (Partial with a Partial output, as ``linear``).
* ``fused_bias_act(x, bias, act_method)``: elementwise, the bias along x's last dim; ``swiglu`` / ``geglu``
  halve the last dim, which is then whole. Quantization inputs are refused.
* ``fused_rotary_position_embedding(q, k, v, sin, cos, position_ids)``: batch and heads keep their sharding
  (heads when the kv heads split with the query groups); the sequence only when sin/cos are given (per
  position, split alike; or whole tables indexed by ``position_ids``, which split with q), since without them
  the kernel numbers each shard's positions from 0; head_dim whole.
* ``fused_feedforward``, ``fused_multi_head_attention``: whole-row ops (layer norms, residuals and, for
  attention, the sequence inside): only the batch dims split; weights replicated.
* ``flash_attn_unpadded``: packed tokens of several sequences (``cu_seqlens``): tokens whole, heads split.
* ``flashmask_attention``: batch split (``startend_row_indices`` alike); heads split when the mask has one
  head row; the sequence whole.
* ``paddle.incubate.softmax_mask_fuse(x, mask)`` (softmax of ``x + mask`` over the last dim; runs on CPU) keeps
  batch, heads and query rows; ``softmax_mask_fuse_upper_triangle(x)`` (causal softmax, GPU only) keeps batch and
  heads (the rows are numbered from 0 on every shard).
Dropout inside a fused kernel draws per rank (no global mask): documented in docs/fused_ops.md.
"""
from __future__ import annotations

from autoparallel.core.placement import BlockShard, Partial, Shard

from spmd_rules.attention import _heads_ok
from spmd_rules.einsum import label_rule, labels_result
from spmd_rules.expand import expand, present
from spmd_rules.matmul import matmul_labels
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import R, check_spec, numel, promote


# ---- matmul + bias ---------------------------------------------------------------------------------------------
def _with_bias(op, x, w, bias, xl, wl, ol, shape):
    check_spec(op, "bias", bias, optional=True)
    if bias is not None and tuple(bias.shape) != (shape[-1],):
        raise ValueError(f"{op}: bias must have shape [{shape[-1]}] (the output's last dim), got {list(bias.shape)}")
    inner = label_rule([xl, wl], [ol], [numel(x), numel(w)])
    last = len(ol) - 1

    def rule(pl, dim):
        (rx, rw), (o,) = inner(pl[:2], dim)
        if pl[2] is None:
            rb = None
        elif isinstance(o, Shard):
            rb = Shard(0) if o.dim == last else R
        else:
            rb = o if isinstance(o, Partial) else R
        return (rx, rw, rb), (o,)

    dtype = promote(*[s.dtype for s in (x, w, bias) if s is not None])
    required, outputs = expand(op, [x, w, bias], [(shape, dtype)], rule, nested=True)
    return SpmdResult(present(required), outputs)


@register_spmd_rule("fused_matmul_bias")
def fused_matmul_bias(x, y, bias=None, transpose_x=False, transpose_y=False, name=None):
    op = "fused_matmul_bias"
    check_spec(op, "x", x)
    check_spec(op, "y", y)
    if x.ndim < 2 or y.ndim != 2:
        raise ValueError(f"{op}: expects x of rank >= 2 and a 2-D y, got shapes {list(x.shape)} and {list(y.shape)}")
    xl, yl, ol, shape = matmul_labels(op, x.shape, y.shape, transpose_x, transpose_y)
    return _with_bias(op, x, y, bias, xl, yl, ol, shape)


@register_spmd_rule("fused_linear")
def fused_linear(x, weight, bias=None, transpose_weight=False, name=None):
    res = fused_matmul_bias(x, weight, bias, False, transpose_weight)
    return SpmdResult(res.inputs, res.outputs)


# ---- bias + activation -----------------------------------------------------------------------------------------
GATED = ("swiglu", "geglu")
ACTS = ("gelu", "relu", "silu", "swish", "sigmoid", "tanh", "identity") + GATED


@register_spmd_rule("fused_bias_act")
def fused_bias_act(x, bias=None, dequant_scales=None, shift=None, smooth=None, act_method="gelu",
                   compute_dtype="default", quant_scale=-1, quant_round_type=0, quant_max_bound=0,
                   quant_min_bound=0):
    op = "fused_bias_act"
    check_spec(op, "x", x)
    check_spec(op, "bias", bias, optional=True)
    if any(t is not None for t in (dequant_scales, shift, smooth)) or quant_scale > 0:
        raise NotImplementedError(f"{op}: quantization (dequant_scales / shift / smooth / quant_scale > 0) has no "
                                  f"spmd rule; call it on plain tensors or register_spmd_rule({op!r})")
    if act_method not in ACTS:
        raise ValueError(f"{op}: act_method must be one of {list(ACTS)}, got {act_method!r}")
    n = x.shape[-1]
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{op}: bias must have shape [{n}] (x's last dim), got {list(bias.shape)}")
    gated = act_method in GATED
    if gated and n % 2:
        raise ValueError(f"{op}: {act_method} halves the last dim, which must be even; got shape {list(x.shape)}")
    last = None if gated else x.ndim - 1
    xl = tuple(range(x.ndim - 1)) + (last,)
    shape = tuple(x.shape[:-1]) + ((n // 2,) if gated else (n,))
    return labels_result(op, [x, bias], [xl, (last,)], [xl], [(shape, x.dtype)], linear=None)


# ---- rotary position embedding ---------------------------------------------------------------------------------
def _rope_table_labels(t, seq_axis, seq, seq_label):
    """Labels of sin/cos ([1, s, 1, d] or [s, d]): the position dim follows the sequence when it is per position."""
    if t is None:
        return ()
    pos = t.ndim - 2 if t.ndim == 2 else seq_axis
    return tuple(seq_label if (j == pos and t.shape[j] == seq) else None for j in range(t.ndim))


@register_spmd_rule("fused_rotary_position_embedding")
def fused_rotary_position_embedding(q, k=None, v=None, sin=None, cos=None, position_ids=None,
                                    use_neox_rotary_style=True, time_major=False, rotary_emb_base=10000.0):
    op = "fused_rotary_position_embedding"
    check_spec(op, "q", q)
    for n, s in (("k", k), ("v", v), ("sin", sin), ("cos", cos), ("position_ids", position_ids)):
        check_spec(op, n, s, optional=True)
    if q.ndim != 4:
        raise ValueError(f"{op}: q must be [batch, seq, heads, head_dim] (or [seq, batch, ...] with time_major), "
                         f"got shape {list(q.shape)}")
    if (sin is None) != (cos is None):
        raise ValueError(f"{op}: sin and cos are given together or not at all")
    sa, ba = (0, 1) if time_major else (1, 0)
    seq = q.shape[sa]
    s_lab = "s" if sin is not None else None        # positions come from the tables (or their ids): split
    t_lab = s_lab if position_ids is None else None   # tables indexed by ids: whole
    kv = [t for t in (k, v) if t is not None]
    for t in kv:
        if t.ndim != 4 or t.shape[ba] != q.shape[ba] or t.shape[sa] != seq or t.shape[3] != q.shape[3]:
            raise ValueError(f"{op}: k/v shape {list(t.shape)} does not match q {list(q.shape)}")
    hk = kv[0].shape[2] if kv else q.shape[2]
    h = "h" if all(_heads_ok(q.shape[2], t.shape[2], set(q.mesh.shape)) for t in kv) else None

    def lab(t):
        out = [None] * 4
        out[ba], out[sa], out[2] = "b", s_lab, (h if t is q or t.shape[2] == hk else None)
        return tuple(out)

    specs = [q, k, v, sin, cos, position_ids]
    labs = [lab(q), lab(k) if k is not None else (), lab(v) if v is not None else (),
            _rope_table_labels(sin, sa, seq, t_lab), _rope_table_labels(cos, sa, seq, t_lab),
            ("b", s_lab) if position_ids is not None else ()]
    outs = [(t, lab(t)) for t in (q, k, v) if t is not None]
    res = labels_result(op, specs, labs, [o[1] for o in outs], [(tuple(t.shape), t.dtype) for t, _ in outs],
                        linear=None, nested=False)
    it = iter(res.outputs)
    return SpmdResult(res.inputs, tuple(next(it) if t is not None else None for t in (q, k, v)))


# ---- whole-row fused blocks: batch only ------------------------------------------------------------------------
def _batch_only(op, x, rows, others, extra=(), out_shape=None):
    """x's leading ``rows`` dims split, every other tensor R (``extra``: (spec, labels) pairs following x, after
    ``others`` in the signature)."""
    xl = tuple(f"b{j}" for j in range(rows)) + (None,) * (x.ndim - rows)
    specs = [x] + list(others) + [s for s, _ in extra]          # signature order
    labs = [xl] + [() if s is None else (None,) * s.ndim for s in others] + [l for _, l in extra]
    shape = tuple(out_shape or x.shape)
    return labels_result(op, specs, labs, [xl[:len(shape)]], [(shape, x.dtype)], linear=None)


def _no_ring(op, ring_id):
    if ring_id != -1:
        raise ValueError(f"{op}: ring_id={ring_id} is paddle's own model-parallel group; with distributed tensors "
                         f"the layouts say how the op splits, so pass ring_id=-1")


@register_spmd_rule("fused_feedforward")
def fused_feedforward(x, linear1_weight, linear2_weight, linear1_bias=None, linear2_bias=None, ln1_scale=None,
                      ln1_bias=None, ln2_scale=None, ln2_bias=None, dropout1_rate=0.5, dropout2_rate=0.5,
                      activation="relu", ln1_epsilon=1e-5, ln2_epsilon=1e-5, pre_layer_norm=False, training=True,
                      mode="upscale_in_train", ring_id=-1, add_residual=True, name=None):
    op = "fused_feedforward"
    check_spec(op, "x", x)
    _no_ring(op, ring_id)
    if linear1_weight.ndim != 2 or linear1_weight.shape[0] != x.shape[-1] or \
            tuple(linear2_weight.shape) != (linear1_weight.shape[1], x.shape[-1]):
        raise ValueError(f"{op}: weights {list(linear1_weight.shape)} and {list(linear2_weight.shape)} do not fit "
                         f"x {list(x.shape)} ([d, ffn] and [ffn, d])")
    others = (linear1_weight, linear2_weight, linear1_bias, linear2_bias, ln1_scale, ln1_bias, ln2_scale, ln2_bias)
    return _batch_only(op, x, x.ndim - 1, others)


@register_spmd_rule("fused_multi_head_attention")
def fused_multi_head_attention(x, qkv_weight, linear_weight, pre_layer_norm=False, pre_ln_scale=None,
                               pre_ln_bias=None, ln_scale=None, ln_bias=None, pre_ln_epsilon=1e-5, qkv_bias=None,
                               linear_bias=None, cache_kv=None, attn_mask=None, dropout_rate=0.5,
                               attn_dropout_rate=0.5, ln_epsilon=1e-5, training=True, mode="upscale_in_train",
                               ring_id=-1, add_residual=True, num_heads=-1, transpose_qkv_wb=False, name=None):
    op = "fused_multi_head_attention"
    check_spec(op, "x", x)
    _no_ring(op, ring_id)
    if cache_kv is not None:
        raise NotImplementedError(f"{op}: cache_kv (decoding) has no spmd rule; call it on plain tensors")
    if x.ndim != 3:
        raise ValueError(f"{op}: x must be [batch, seq, embed], got shape {list(x.shape)}")
    extra = ()
    if attn_mask is not None:
        check_spec(op, "attn_mask", attn_mask)
        extra = ((attn_mask, ("b0" if attn_mask.shape[0] == x.shape[0] else None,) + (None,) * (attn_mask.ndim - 1)),)
    others = (qkv_weight, linear_weight, pre_ln_scale, pre_ln_bias, ln_scale, ln_bias, qkv_bias, linear_bias)
    return _batch_only(op, x, 1, others, extra)


# ---- attention over packed tokens / flashmask ------------------------------------------------------------------
@register_spmd_rule("flash_attn_unpadded")
def flash_attn_unpadded(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                        dropout=0.0, causal=False, return_softmax=False, fixed_seed_offset=None, rng_name="",
                        training=True, name=None):
    op = "flash_attn_unpadded"
    for n, s in (("query", query), ("key", key), ("value", value), ("cu_seqlens_q", cu_seqlens_q),
                 ("cu_seqlens_k", cu_seqlens_k)):
        check_spec(op, n, s)
    if query.ndim != 3 or key.ndim != 3 or tuple(key.shape) != tuple(value.shape[:2]) + (key.shape[2],):
        raise ValueError(f"{op}: expects [tokens, heads, head_dim] tensors, got {list(query.shape)}, "
                         f"{list(key.shape)}, {list(value.shape)}")
    if return_softmax:
        raise NotImplementedError(f"{op}: return_softmax=True has no spmd rule (a debugging output)")
    hq, hk = query.shape[1], key.shape[1]
    h = "h" if _heads_ok(hq, hk, set(query.mesh.shape)) else None
    ql, kl = (None, h, None), (None, h, None)
    out = ((query.shape[0], hq, value.shape[2]), query.dtype)
    res = labels_result(op, [query, key, value, cu_seqlens_q, cu_seqlens_k], [ql, kl, kl, (None,), (None,)],
                        [ql], [out], linear={2}, nested=False)
    return SpmdResult(res.inputs, res.outputs + (None,))


@register_spmd_rule("flashmask_attention")
def flashmask_attention(query, key, value, startend_row_indices=None, *, dropout=0.0, causal=False,
                        window_size=None, return_softmax_lse=False, return_seed_offset=False,
                        fixed_seed_offset=None, rng_name="", training=True, name=None, softmax_scale=None,
                        block_mask=None):
    op = "flashmask_attention"
    for n, s in (("query", query), ("key", key), ("value", value)):
        check_spec(op, n, s)
        if s.ndim != 4:
            raise ValueError(f"{op}: {n} must be [batch, seq, heads, head_dim], got shape {list(s.shape)}")
    if return_softmax_lse or return_seed_offset or block_mask is not None:
        raise NotImplementedError(f"{op}: return_softmax_lse / return_seed_offset / block_mask have no spmd rule")
    hq, hk = query.shape[2], key.shape[2]
    m = check_spec(op, "startend_row_indices", startend_row_indices, optional=True)
    one_head_mask = m is None or m.shape[1] == 1
    h = "h" if one_head_mask and _heads_ok(hq, hk, set(query.mesh.shape)) else None
    ql = ("b", None, h, None)
    specs, labs = [query, key, value], [ql, ql, ql]
    if m is not None:
        specs.append(m)
        labs.append(("b" if m.shape[0] == query.shape[0] else None, None, None, None))
    out = ((query.shape[0], query.shape[1], hq, value.shape[3]), query.dtype)
    return labels_result(op, specs, labs, [ql], [out], linear={2}, nested=False)


# ---- fused softmax of attention scores ---------------------------------------------------------------------------
def _scores(op, x):
    check_spec(op, "x", x)
    if x.ndim != 4:
        raise ValueError(f"{op}: x must be attention scores [batch, heads, q_seq, k_seq], got shape {list(x.shape)}")


@register_spmd_rule("softmax_mask_fuse")
def softmax_mask_fuse(x, mask, name=None):
    op = "softmax_mask_fuse"
    _scores(op, x)
    check_spec(op, "mask", mask)
    if mask.ndim != 4 or mask.shape[1] != 1 or (mask.shape[0], mask.shape[2], mask.shape[3]) != \
            (x.shape[0], x.shape[2], x.shape[3]):
        raise ValueError(f"{op}: mask must be [batch, 1, q_seq, k_seq] for x {list(x.shape)}, got {list(mask.shape)}")
    return labels_result(op, [x, mask], [("b", "h", "s", None), ("b", None, "s", None)], [("b", "h", "s", None)],
                         [(tuple(x.shape), x.dtype)], linear=None)


@register_spmd_rule("softmax_mask_fuse_upper_triangle")
def softmax_mask_fuse_upper_triangle(x):
    op = "softmax_mask_fuse_upper_triangle"
    _scores(op, x)
    lab = ("b", "h", None, None)
    return labels_result(op, [x], [lab], [lab], [(tuple(x.shape), x.dtype)], linear=None)
