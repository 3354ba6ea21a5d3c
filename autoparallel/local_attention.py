"""Attention with dropout in training on distributed tensors (the group op ``sharded_attention_dropout``).

Paddle's CPU attention (``scaled_dot_product_attention`` / ``flash_attention``'s math path) drops the attention
probabilities [batch, heads, q_seq, k_seq] with ``F.dropout``. Here ONE keep-mask is drawn for that global shape
from the shared generator, as a single process draws it, and each rank computes its shard of the attention with
its slice of the mask (``local_slices``: batch, heads and query-sequence ranges), so every layout gives the
single-process values for the same seed. The local math mirrors paddle's: grouped kv heads repeated, a bool mask
turned into 0 / -inf, the causal mask as paddle's upper triangle of -1e4, scale ``head_dim ** -0.5`` unless given.
"""
from __future__ import annotations

import paddle
import paddle.nn.functional as F

_SDPA = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "training", "backend", "scale",
         "enable_gqa", "name"]
_FLASH = ["query", "key", "value", "dropout", "causal", "return_softmax"]


def _bound(args, kwargs):
    names = _SDPA if kwargs["attention_op"] == "scaled_dot_product_attention" else _FLASH
    b = dict(zip(names, args))
    b.update(kwargs)
    if b["attention_op"] == "scaled_dot_product_attention":
        return b["dropout_p"] if "dropout_p" in b else 0.0, b.get("is_causal", False), b.get("attn_mask"), \
            b.get("scale"), b
    return b.get("dropout", 0.0), b.get("causal", False), None, None, b     # paddle's math path: default scale


def _local(q, k, v, mask, causal, scale, keep):
    """One rank's attention ([batch, seq, heads, dim] in and out; unbatched [seq, heads, dim] as a batch of one,
    as paddle runs it) with its slice of the keep-mask."""
    if q.ndim == 3:
        o, w = _local(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, causal, scale, keep)
        return o.squeeze(0), w
    if k.shape[2] and q.shape[2] != k.shape[2]:
        g = q.shape[2] // k.shape[2]
        k, v = (t.unsqueeze(3).expand([-1, -1, -1, g, -1]).flatten(2, 3) for t in (k, v))
    q, k, v = (paddle.transpose(t, [0, 2, 1, 3]) for t in (q, k, v))
    d = q.shape[-1]
    scale = scale or (d ** -0.5 if d else 1.0)
    product = paddle.matmul(q * scale, k, transpose_y=True)
    if causal:
        product = product + paddle.triu(paddle.full_like(product, -1e4), diagonal=1)
    elif mask is not None:
        if mask.dtype == paddle.bool:
            mask = paddle.where(mask, paddle.to_tensor(0.0, dtype=q.dtype),
                                paddle.to_tensor(-float("inf"), dtype=q.dtype))
        product = product + mask
    weights = F.softmax(product) * keep.astype(product.dtype)
    return paddle.transpose(paddle.matmul(weights, v), [0, 2, 1, 3]), weights


def sharded_attention_dropout(mesh, calls):
    from autoparallel.rng_agree import agreed_generator

    any_args, any_kwargs = next(iter(calls.values()))
    p, _, _, _, b = _bound(any_args, any_kwargs)
    with paddle.no_grad(), agreed_generator(mesh):
        keep = F.dropout(paddle.ones(b["global_shape"], dtype=b["query"].dtype), p=p, training=True,
                         mode="upscale_in_train")
    out = {}
    for r, (args, kwargs) in calls.items():
        _, causal, mask, scale, bb = _bound(args, kwargs)
        piece = keep[tuple(slice(a0, a1) for a0, a1 in bb["local_slices"])]
        o, w = _local(bb["query"], bb["key"], bb["value"], mask, causal, scale, piece)
        if bb["attention_op"] == "scaled_dot_product_attention":
            out[r] = o
        else:
            out[r] = (o, w if bb.get("return_softmax") else None)
    return out
