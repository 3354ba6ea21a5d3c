"""``paddle.incubate.nn.functional`` and the varlen / mask attention entry points on distributed tensors.

* ``fused_rms_norm``, ``fused_layer_norm`` run (forward only) on CPU in paddle 3.3: here they are
  decompositions into routed ops, so the normalized dims are gathered whole, the rows keep their sharding, and
  the backward exists (paddle's CPU build has no ``fused_rms_norm`` grad kernel). Semantics checked against
  paddle's CPU forward: ``h = x + bias + residual * residual_alpha`` (rms: alpha 1), ``out = norm(h) * w + b``;
  outputs ``(out, residual_out)`` (rms) and ``(out, residual_out, mean, 1/std)`` (layer norm; statistics
  flattened over the rows, float32). Without ``residual`` paddle returns a placeholder as ``residual_out``; here
  an empty [0] tensor. Quantized outputs (``quant_scale > 0``) are refused.
* ``flash_attn_qkvpacked`` splits ``qkv`` as paddle does and calls the routed ``flash_attention`` (it was
  reachable only by its module path; ``F.flash_attn_qkvpacked`` was guarded).
* ``fused_dropout_add`` is paddle 3.3's own fallback, ``dropout(x) + y``, written with routed ops.
* The GPU-only kernels (``fused_linear``, ``fused_matmul_bias``, ``fused_bias_act``,
  ``fused_rotary_position_embedding``, ``fused_feedforward``, ``fused_multi_head_attention``,
  ``flash_attn_unpadded``, ``flashmask_attention``, ``paddle.incubate.softmax_mask_fuse_upper_triangle``)
  route to their spmd rule (``spmd_rules/fused.py``) on a GPU; on CPU they raise ``NotImplementedError`` naming
  the op, the device and the CPU alternative, instead of paddle's missing-kernel error deep in the C++ stack.
"""
from __future__ import annotations

from spmd_rules.composites import gshape

_IF = "paddle.incubate.nn.functional"
_FA = "paddle.nn.functional.flash_attention"

CPU_ALTERNATIVE = {
    "fused_linear": "paddle.nn.functional.linear",
    "fused_matmul_bias": "paddle.matmul(x, y) + bias",
    "fused_bias_act": "the activation of paddle.nn.functional on x + bias",
    "fused_rotary_position_embedding": "x * cos + rotate_half(x) * sin written with paddle ops",
    "fused_feedforward": "paddle.nn.Linear / LayerNorm / Dropout layers",
    "fused_multi_head_attention": "paddle.nn.MultiHeadAttention or F.scaled_dot_product_attention",
    "flash_attn_unpadded": "F.scaled_dot_product_attention on padded [batch, seq, heads, dim] tensors",
    "flashmask_attention": "F.scaled_dot_product_attention with an attn_mask",
    "softmax_mask_fuse_upper_triangle": "F.softmax(x + paddle.triu(paddle.full_like(x, -1e4), 1))",
}


def _device():
    import paddle

    return paddle.get_device()


def gpu_kernel(op: str, path: str):
    """The decomposition of a GPU-only kernel: a typed error on CPU, the op's spmd rule elsewhere."""
    def run(*args, **kwargs):
        dev = _device()
        if dev.startswith("cpu"):
            raise NotImplementedError(f"{op} has no CPU kernel in paddle (device {dev!r}), on distributed tensors "
                                      f"or not; on CPU use {CPU_ALTERNATIVE[op]}. Its spmd rule {op!r} applies on "
                                      f"GPU")
        from autoparallel import dispatch

        return dispatch.run(op, path, args, kwargs)

    run.__name__ = op
    return run


def _no_quant(op, quant_scale):
    if quant_scale is not None and quant_scale > 0:
        raise NotImplementedError(f"{op}: quant_scale={quant_scale} (int8 output) is not supported on distributed "
                                  f"tensors; call it with quant_scale=-1")


def _pre(x, bias, residual, alpha=1.0):
    h = x if bias is None else x + bias
    return h if residual is None else h + residual * alpha


def _affine(y, w, b, shape):
    if w is not None:
        y = y * w.reshape(shape)
    return y if b is None else y + b.reshape(shape)


def _empty(x):
    import paddle

    return paddle.empty([0], dtype=x.dtype)


def fused_rms_norm(x, norm_weight, norm_bias, epsilon, begin_norm_axis=1, bias=None, residual=None,
                   quant_scale=-1, quant_round_type=0, quant_max_bound=0, quant_min_bound=0):
    import paddle

    _no_quant("fused_rms_norm", quant_scale)
    shape = gshape(x)
    nd = len(shape)
    begin = begin_norm_axis + nd if begin_norm_axis < 0 else begin_norm_axis
    axes = list(range(begin, nd))
    h = _pre(x, bias, residual)
    out = h * paddle.rsqrt((h * h).mean(axis=axes, keepdim=True) + epsilon)
    out = _affine(out, norm_weight, norm_bias, shape[begin:])
    return out, (h if residual is not None else _empty(x))


def fused_layer_norm(x, norm_weight, norm_bias, epsilon, residual_alpha=1.0, begin_norm_axis=1, bias=None,
                     residual=None, quant_scale=-1, quant_round_type=0, quant_max_bound=0, quant_min_bound=0):
    import paddle

    _no_quant("fused_layer_norm", quant_scale)
    shape = gshape(x)
    nd = len(shape)
    begin = begin_norm_axis + nd if begin_norm_axis < 0 else begin_norm_axis
    axes = list(range(begin, nd))
    h = _pre(x, bias, residual, residual_alpha)
    mean = h.mean(axis=axes, keepdim=True)
    c = h - mean
    inv = paddle.rsqrt((c * c).mean(axis=axes, keepdim=True) + epsilon)
    out = _affine(c * inv, norm_weight, norm_bias, shape[begin:])
    stats = [t.reshape([-1]).astype("float32") for t in (mean, inv)]
    return out, (h if residual is not None else _empty(x)), stats[0], stats[1]


def fused_dropout_add(x, y, p=0.5, training=True, mode="upscale_in_train", name=None):
    """Paddle 3.3 itself runs ``dropout(x) + y`` (its fused kernel is disabled): the same here, so the dropout
    rule draws the global keep-mask (single-process values for the same seed)."""
    import paddle.nn.functional as F

    if mode not in ("downscale_in_infer", "upscale_in_train"):
        raise ValueError(f"fused_dropout_add: mode must be 'downscale_in_infer' or 'upscale_in_train', got {mode!r}")
    if isinstance(p, (int, float)) and p == 0:
        return x + y
    return F.dropout(x, p, training=training, mode=mode) + y


def flash_attn_qkvpacked(qkv, dropout=0.0, causal=False, return_softmax=False, *, fixed_seed_offset=None,
                         rng_name="", training=True, name=None):
    """Paddle's own split of ``qkv`` [batch, seq, groups + 2, kv_heads, dim] (query heads ``groups * kv_heads``),
    then the routed ``flash_attention`` (paddle's CPU path runs the same math on the same split)."""
    import paddle.nn.functional as F

    b, s, _, _, d = gshape(qkv)
    q = qkv[:, :, :-2].reshape([b, s, -1, d])
    return F.flash_attention.flash_attention(q, qkv[:, :, -2], qkv[:, :, -1], dropout, causal, return_softmax,
                                             fixed_seed_offset=fixed_seed_offset, rng_name=rng_name,
                                             training=training)


COMPOSITES = {
    f"{_IF}.fused_rms_norm": fused_rms_norm,
    f"{_IF}.fused_layer_norm": fused_layer_norm,
    f"{_IF}.fused_dropout_add": fused_dropout_add,
    **{f"{_IF}.{op}": gpu_kernel(op, f"{_IF}.{op}")
       for op in ("fused_linear", "fused_matmul_bias", "fused_bias_act", "fused_rotary_position_embedding",
                  "fused_feedforward", "fused_multi_head_attention")},
    f"{_FA}.flash_attn_unpadded": gpu_kernel("flash_attn_unpadded", f"{_FA}.flash_attn_unpadded"),
    f"{_FA}.flashmask_attention": gpu_kernel("flashmask_attention", f"{_FA}.flashmask_attention"),
    f"{_FA}.flash_attn_qkvpacked": flash_attn_qkvpacked,
    "paddle.incubate.softmax_mask_fuse_upper_triangle": gpu_kernel("softmax_mask_fuse_upper_triangle",
                                                                   "paddle.incubate.softmax_mask_fuse_upper_triangle"),
}
