"""cross_entropy, including vocab-parallel logits.

Labels: every input dim but the class axis is a batch label shared with ``label``; the class axis is
shared with a soft label only. On one mesh dim the larger of input/label keeps its sharding:

* a batch dim sharded: reduction 'none' -> the loss is sharded on it; 'sum' -> Partial(sum) from the
  plain local op; 'mean' -> Partial(sum) from the local op ``global_mean_cross_entropy``: local sum of the
  (weighted) per-example losses divided by the GLOBAL divisor of paddle's mean (``autoparallel.local_ce``:
  the number of examples with the default ignore_index -100, ignored ones included; the count or class-weight
  sum of non-ignored labels otherwise), which the runtime all-reduces over ``local_attrs()['batch_mesh_dims']``;
* the class axis sharded (vocab-parallel logits): the output is R and the local op is
  ``vocab_parallel_cross_entropy``: this rank holds classes ``[class_start, class_end)``; the runtime
  all-reduces the max logit, the sum of exponentials and the target logit (or the soft-label dot
  product; label smoothing: the row sum) over ``class_mesh_dims`` and, for 'mean' over a sharded batch,
  the divisor over ``batch_mesh_dims``; the logits are never gathered.

Partial inputs need R; the class ``weight`` is R.
"""
from __future__ import annotations

from autoparallel.core.placement import Partial, Shard

from spmd_rules.einsum import label_rule
from spmd_rules.expand import expand, present
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import R, check_spec, norm_axis, numel


@register_spmd_rule("cross_entropy")
def cross_entropy(input, label, weight=None, ignore_index=-100, reduction="mean", soft_label=False, axis=-1,
                  use_softmax=True, label_smoothing=0.0, name=None):
    op = "cross_entropy"
    check_spec(op, "input", input)
    check_spec(op, "label", label)
    check_spec(op, "weight", weight, optional=True)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{op}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    a = norm_axis(op, axis, input.ndim)
    C = input.shape[a]
    xl = tuple("class" if d == a else d for d in range(input.ndim))
    batch_shape = tuple(s for d, s in enumerate(input.shape) if d != a)
    if soft_label:
        if tuple(label.shape) != tuple(input.shape):
            raise ValueError(f"{op}: a soft label must have the input's shape {list(input.shape)}, got "
                             f"{list(label.shape)}")
        ll = xl
        none_labels = tuple(None if d == a else d for d in range(input.ndim))
        none_shape = tuple(1 if d == a else s for d, s in enumerate(input.shape))
    else:
        if tuple(label.shape) == batch_shape:
            ll = tuple(d for d in range(input.ndim) if d != a)
        elif label.ndim == input.ndim and label.shape[a] == 1 and \
                tuple(s for d, s in enumerate(label.shape) if d != a) == batch_shape:
            ll = tuple(None if d == a else d for d in range(input.ndim))
        else:
            raise ValueError(f"{op}: label shape {list(label.shape)} does not match input shape "
                             f"{list(input.shape)} (expected {list(batch_shape)} or with a 1 at axis {a})")
        none_labels, none_shape = ll, tuple(label.shape)
        if label_smoothing > 0:                     # paddle smooths into a soft label: the loss keeps the 1
            none_labels = tuple(None if d == a else d for d in range(input.ndim))
            none_shape = tuple(1 if d == a else s for d, s in enumerate(input.shape))
    if weight is not None and tuple(weight.shape) != (C,):
        raise ValueError(f"{op}: weight must have shape [{C}], got {list(weight.shape)}")
    out_labels, out_shape = (none_labels, none_shape) if reduction == "none" else ((), ())
    inner = label_rule([xl, ll], [out_labels], [numel(input), numel(label)], linear=None)

    def rule(pl, dim):
        (ri, rl), (o,) = inner(pl[:2], dim)
        if isinstance(ri, Shard) and ri.dim == a:
            o = R                                   # the collective local op completes the loss
        return (ri, rl, None if pl[2] is None else R), (o,)

    required, outputs = expand(op, [input, label, weight], [(out_shape, input.dtype)], rule, nested=True)
    ri = required[0]
    class_dims = tuple(ri.shard_mesh_dims(a))
    batch_dims = tuple(m for m, p in enumerate(ri.placements) if isinstance(p, Shard) and p.dim != a)
    if class_dims:
        def attrs(coords):
            s, e = ri.local_range(coords, a)
            return {"class_start": s, "class_end": e, "class_count": C, "class_mesh_dims": class_dims,
                    "batch_mesh_dims": batch_dims}

        return SpmdResult(present(required), outputs, "vocab_parallel_cross_entropy", attrs)
    if reduction == "mean" and any(isinstance(p, Partial) for p in outputs[0].placements):
        return SpmdResult(present(required), outputs, "global_mean_cross_entropy",
                          lambda coords: {"batch_mesh_dims": batch_dims})
    return SpmdResult(present(required), outputs)
