"""embedding (including vocab-parallel) and one_hot.

embedding(x, weight): ids sharded on any dim give an output sharded on that dim; weight sharded on the
hidden dim (1) gives an output sharded on its last dim; weight sharded on the VOCAB dim (0) is
vocab-parallel: ids are required R, the output is Partial(sum) and the local op is
``vocab_parallel_embedding`` — a masked lookup: ids outside this rank's vocab rows
``[vocab_start, vocab_end)`` (from ``local_attrs``) look up row 0 and are zeroed; ``padding_idx`` is
given relative to the local rows (None when this rank does not hold it); with ``scale_grad_by_freq`` the
ids are whole (R), so each row's gradient is divided by its count over every id. A Partial weight passes
(the lookup is linear in the weight). When ids and weight are sharded on one mesh dim, the larger keeps
its sharding.
"""
from __future__ import annotations

from autoparallel.core.placement import Partial, Shard

from spmd_rules.expand import expand, present
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import R, check_spec, is_linear_partial, numel


def _check_ids(op, x):
    check_spec(op, "x", x)
    if x.dtype not in ("int64", "int32", "int16", "int8", "uint8"):
        raise TypeError(f"{op}: x must hold integer ids, got dtype {x.dtype}")


@register_spmd_rule("embedding")
def embedding(x, weight, padding_idx=None, max_norm=None, norm_type=2.0, sparse=False, scale_grad_by_freq=False,
              name=None):
    op = "embedding"
    _check_ids(op, x)
    check_spec(op, "weight", weight)
    if weight.ndim != 2:
        raise ValueError(f"{op}: weight must be 2-D [vocab, hidden], got shape {list(weight.shape)}")
    vocab, hidden = weight.shape
    if sparse:
        raise NotImplementedError(f"{op}: sparse=True (paddle.nn.Embedding(..., sparse=True)) on distributed tensors: "
                                  f"a sparse (SelectedRows) gradient cannot be reduced across ranks or sharded; "
                                  f"build the embedding with sparse=False (the same values, a dense gradient)")
    if padding_idx is not None:
        if not -vocab <= padding_idx < vocab:
            raise ValueError(f"{op}: padding_idx {padding_idx} is out of range for a vocab of {vocab}")
        padding_idx = padding_idx % vocab
    out_last = x.ndim

    def rule(pl, dim):
        px, pw = pl
        if is_linear_partial(pw):
            return (R, pw), (pw,)
        pw = pw if isinstance(pw, Shard) and not (pw.dim == 1 and max_norm is not None) else R
        px = px if isinstance(px, Shard) and not scale_grad_by_freq else R     # frequencies of every id
        if isinstance(pw, Shard) and isinstance(px, Shard):
            if numel(x) > numel(weight):
                pw = R
            else:
                px = R
        if isinstance(pw, Shard):
            return (R, pw), ((Partial("sum") if pw.dim == 0 else Shard(out_last)),)
        return (px, R), (px,)

    required, outputs = expand(op, [x, weight], [(tuple(x.shape) + (hidden,), weight.dtype)], rule, nested=True)
    w = required[1]
    if not w.shard_mesh_dims(0):
        return SpmdResult(required, outputs)

    def local_attrs(coords):
        a, b = w.local_range(coords, 0)
        pad = padding_idx - a if padding_idx is not None and a <= padding_idx < b else None
        return {"vocab_start": a, "vocab_end": b, "padding_idx": pad, "vocab_size": w.shape[0]}

    return SpmdResult(present(required), outputs, "vocab_parallel_embedding", local_attrs)


@register_spmd_rule("one_hot")
def one_hot(x, num_classes=-1, name=None):
    from spmd_rules.einsum import labels_result

    _check_ids("one_hot", x)
    if not isinstance(num_classes, int) or num_classes <= 0:
        raise ValueError(f"one_hot: num_classes must be a positive int (the spec has no values), got {num_classes!r}")
    xl = tuple(range(x.ndim))
    return labels_result("one_hot", [x], [xl], [xl + (None,)], [(tuple(x.shape) + (num_classes,), "float32")],
                         linear=None)


