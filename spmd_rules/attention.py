"""Attention: scaled_dot_product_attention, flash_attention (paddle layout [batch, seq, heads, head_dim];
scaled_dot_product_attention also unbatched [seq, heads, head_dim]) and rotary_embedding.

Batch and heads may be sharded (query, key, value and the mask alike); with grouped-query attention the
heads stay shardable when every rank's query heads use exactly its key/value heads (the kv heads split
evenly with the query groups). Nested sharding (two mesh dims on one dim) is not kept: query and kv
heads nest differently. The query sequence may be sharded when attention is not causal (key and
value are then R); key/value sequence and head_dim are whole (no ring attention). Linear in ``value``
only (a Partial value passes). With dropout in training the local op is ``sharded_attention_dropout``:
the runtime draws the dropout mask for the GLOBAL attention-probability shape [batch, heads, q_seq,
k_seq] (``local_attrs``: ``global_shape``) from the mesh-synchronised generator and applies this rank's
``local_slices``.

rotary_embedding(x, cos, sin) = x * cos + rotate_half(x) * sin (rotate_half: [-x2, x1] of the halves of
the last dim); cos/sin broadcast against x. The last dim must be whole; the rest is elementwise and
linear in x.
"""
from __future__ import annotations

from autoparallel.core.placement import chunk_range

from spmd_rules.einsum import labels_result
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import broadcast_shapes, check_spec, promote


def _heads_ok(hq, hk, sizes) -> bool:
    if hk == 0 or hq % hk:
        return False
    g = hq // hk
    return all(chunk_range(hq, k, r) == tuple(g * v for v in chunk_range(hk, k, r)) for k in sizes for r in range(k))


def _attention(op, q, k, v, mask, causal, dropout, training, unbatched_ok=False):
    """Specs, labels, output labels and meta, local op. ``unbatched_ok``: [seq, heads, head_dim] inputs too (paddle
    adds a batch of one; the mask then broadcasts against [1, heads, q_seq, k_seq])."""
    nd = q.ndim
    for n, t in (("query", q), ("key", k), ("value", v)):
        check_spec(op, n, t)
        if t.ndim != 4 and not (unbatched_ok and t.ndim == 3 == nd):
            form = "[batch, seq, heads, head_dim] (or [seq, heads, head_dim])" if unbatched_ok else \
                "[batch, seq, heads, head_dim]"
            raise ValueError(f"{op}: {n} must be {form}, got shape {list(t.shape)}")
    pad = (1,) * (4 - nd)
    qs, ks, vs = (pad + tuple(t.shape) for t in (q, k, v))
    b, sq, hq, d = qs
    if ks[0] != b or vs[0] != b or ks[1] != vs[1] or ks[2] != vs[2] or ks[3] != d:
        raise ValueError(f"{op}: incompatible shapes query {list(q.shape)}, key {list(k.shape)}, value {list(v.shape)}")
    hk = ks[2]
    if hq % hk:
        raise ValueError(f"{op}: query heads {hq} must be a multiple of key/value heads {hk}")
    h = "h" if _heads_ok(hq, hk, set(q.mesh.shape)) else None
    s = None if causal else "s"
    bl = "b" if nd == 4 else None
    cut = 4 - nd
    ql, kl = (bl, s, h, None)[cut:], (bl, None, h, None)[cut:]
    specs, labs = [q, k, v], [ql, kl, kl]
    if mask is not None:
        check_spec(op, "attn_mask", mask)
        full = (b, hq, sq, ks[1])
        broadcast_shapes(op, mask.shape, full)
        want = (bl, h, s, None)
        off = 4 - mask.ndim
        labs.append(tuple(want[off + j] if mask.shape[j] == full[off + j] else None for j in range(mask.ndim)))
        specs.append(mask)
    out = ((b, sq, hq, vs[3])[cut:], q.dtype)
    local_op = "sharded_attention_dropout" if dropout and training else None
    return specs, labs, ql, out, local_op


def _dropout_attrs(res, op):
    """Global attention-probability shape [batch, heads, q_seq, k_seq] and this rank's slice of it (and which
    signature the local call has: ``attention_op``)."""
    q, k = res.inputs[0], res.inputs[1]
    cut = 4 - q.ndim                     # an unbatched call: a batch of one
    shape = [1 if cut else q.shape[0], q.shape[2 - cut], q.shape[1 - cut], k.shape[1 - cut]]

    def attrs(coords):
        return {"attention_op": op, "global_shape": shape,
                "local_slices": [[0, 1] if cut else list(q.local_range(coords, 0)),
                                 list(q.local_range(coords, 2 - cut)), list(q.local_range(coords, 1 - cut)),
                                 [0, shape[3]]]}

    return SpmdResult(res.inputs, res.outputs, res.local_op, attrs) if res.local_op else res


@register_spmd_rule("scaled_dot_product_attention")
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, training=True,
                                 backend=None, scale=None, enable_gqa=True, name=None):
    op = "scaled_dot_product_attention"
    specs, labs, ol, out, local_op = _attention(op, query, key, value, attn_mask, is_causal, dropout_p, training,
                                                unbatched_ok=True)
    return _dropout_attrs(labels_result(op, specs, labs, [ol], [out], linear={2}, local_op=local_op, nested=False), op)


@register_spmd_rule("flash_attention")
def flash_attention(query, key, value, dropout=0.0, causal=False, return_softmax=False, *, fixed_seed_offset=None,
                    rng_name="", training=True, name=None, softmax_scale=None):
    op = "flash_attention"
    specs, labs, ol, out, local_op = _attention(op, query, key, value, None, causal, dropout, training)
    b, sq, hq, _ = query.shape
    outs, metas = [ol], [out]
    if return_softmax:
        outs.append(("b", ol[2], ol[1], None))
        metas.append(((b, hq, sq, key.shape[1]), query.dtype))
    res = _dropout_attrs(labels_result(op, specs, labs, outs, metas, linear={2}, local_op=local_op, nested=False), op)
    if not return_softmax:
        res = SpmdResult(res.inputs, res.outputs + (None,), res.local_op, res.local_attrs)
    return res


@register_spmd_rule("rotary_embedding")
def rotary_embedding(x, cos, sin):
    op = "rotary_embedding"
    for n, s in (("x", x), ("cos", cos), ("sin", sin)):
        check_spec(op, n, s)
    if x.shape[-1] % 2:
        raise ValueError(f"{op}: the last dim of x must be even (rotate_half), got shape {list(x.shape)}")
    shape = broadcast_shapes(op, x.shape, cos.shape, sin.shape)
    if tuple(shape) != tuple(x.shape):
        raise ValueError(f"{op}: cos {list(cos.shape)} and sin {list(sin.shape)} must broadcast to x {list(x.shape)}")
    nd = x.ndim
    labs = []
    for t in (x, cos, sin):
        off = nd - t.ndim
        labs.append(tuple(None if (off + j == nd - 1 or t.shape[j] != shape[off + j]) else off + j
                          for j in range(t.ndim)))
    return labels_result(op, [x, cos, sin], labs, [labs[0]], [(shape, promote(x.dtype, cos.dtype, sin.dtype))],
                         linear={0})
