"""Local implementations named by rules (``SpmdResult.local_op``).

Per-rank ops run on one rank's shards. Group ops see every held rank at once, because they communicate
(vocab-parallel cross entropy) or must draw one random tensor for the whole global shape (dropout).
"""
from __future__ import annotations

import paddle
import paddle.nn.functional as F

from autoparallel.local_attention import sharded_attention_dropout
from autoparallel.local_ce import check_ids, global_mean_cross_entropy, mesh_reduce, vocab_parallel_cross_entropy
from autoparallel.local_ce import sum_both as _stat_sum
from autoparallel.local_scatter import sharded_masked_scatter


# ---- per-rank ----------------------------------------------------------------------------------------
def vocab_parallel_embedding(x, weight, padding_idx=None, max_norm=None, norm_type=2.0, sparse=False,
                             scale_grad_by_freq=False, name=None, *, vocab_start, vocab_end, vocab_size=None):
    """Masked lookup of this rank's rows [vocab_start, vocab_end); other ids give zeros (Partial sum). The mask
    selects (``where``) rather than multiplies: a non-finite gradient at another rank's id (an fp16 overflow
    that one process drops at the padding row) would otherwise reach local row 0 as inf * 0 = NaN. An id no
    rank holds raises, as paddle's embedding does (the mask would make it a silent zero vector)."""
    check_ids(x, vocab_size, "embedding: input ids")
    if weight.shape[0] == 0:            # an empty vocab shard (3 rows over 4 ranks): paddle's kernel refuses any id
        return _empty_lookup(x, weight)
    mask = (x >= vocab_start) & (x < vocab_end)
    if scale_grad_by_freq:       # other ranks' ids look up an extra zero row: only this rank's rows are counted
        ids = paddle.where(mask, x - vocab_start, paddle.full_like(x, weight.shape[0]))
        extra = paddle.zeros([1, weight.shape[1]], dtype=weight.dtype)
        out = F.embedding(ids, paddle.concat([weight, extra]), padding_idx=padding_idx, scale_grad_by_freq=True)
    else:
        ids = paddle.where(mask, x - vocab_start, paddle.zeros_like(x))
        out = F.embedding(ids, weight, padding_idx=padding_idx, sparse=sparse)
    return paddle.where(mask.unsqueeze(-1), out, paddle.zeros([1], dtype=out.dtype))     # broadcast, no copies


def _empty_lookup(x, weight):
    """Zeros for every id, joined to ``weight`` so its empty shard gets an empty gradient as one process's
    rows would (a rank holding no row of the vocabulary contributes nothing to the Partial sum)."""
    zeros = paddle.zeros(list(x.shape) + [weight.shape[1]], dtype=weight.dtype)
    return zeros + weight.sum() * 0 if not weight.stop_gradient else zeros


def global_mean(x, axis=None, keepdim=False, name=None, *, global_count, dtype=None):
    """Local sum divided by the global element count (a Partial(sum) term of the mean)."""
    return paddle.sum(x, axis=axis, dtype=dtype, keepdim=keepdim) / global_count


def row_of_shard(x, index=None, *, row):
    """``x[row]`` on the rank holding the row, zeros of a row's shape elsewhere (a Partial(sum) term).

    The zeros are joined to ``x`` (through its empty slice ``x[:0]``, so no value of ``x`` enters them: an inf
    stays out), as one process's ``x[i]`` gives every unselected row a zero gradient: a rank with unjoined
    zeros got no gradient at all, so the tensor's ``.grad`` read None and its collectives' backward saw a
    stopped input."""
    if row is not None:
        return x[row]
    zeros = paddle.zeros([1] + list(x.shape[1:]), dtype=x.dtype)
    if x.stop_gradient or not paddle.is_grad_enabled():
        return zeros[0]
    return paddle.concat([x[:0], zeros], axis=0)[0]


def gather_slice(x, index, axis=None, name=None):
    """``paddle.gather(x, i, axis)`` with a 0-d index ``i``: the slice at ``i``, the axis dropped. Run as
    ``index_select`` of one row then ``squeeze``: paddle 3.3's gather kernel gives these values, but its gradient
    along an axis other than 0 is wrong (it scatters into other positions of ``x``)."""
    a = 0 if axis is None else int(axis) % len(x.shape)
    return paddle.index_select(x, index.reshape([1]), axis=a).squeeze(a)


def setitem(x, index, value):
    """``x[index] = value`` on a copy (the caller rebinds ``x`` to it). paddle's ``set_value`` leaves an empty
    value (this rank's empty shard of it: 3 rows over 4 ranks) out of the graph, so its gradient stayed None
    on that rank: the copy is joined to it by a zero term, and the value's gradient is empty as its shard. On an
    empty shard of x (7 columns over 4 ranks: 2, 2, 2, 0) nothing is written: paddle's backward of a write into
    an empty region leaves a broadcast value's gradient uninitialized (garbage summed into the value's gradient),
    so the write is skipped and the value joined by the zero term."""
    y = x.clone()
    if 0 in x.shape:
        if isinstance(value, paddle.Tensor) and not value.stop_gradient:
            y = y + (value.sum() * 0).astype(y.dtype)
        return y
    y[index] = value
    if isinstance(value, paddle.Tensor) and not value.stop_gradient and 0 in value.shape:
        y = y + (value.sum() * 0).astype(y.dtype)
    return y


def view_shape(x, shape_or_dtype, name=None):
    """``x.view(shape)`` on a local shard; an empty shard (a data-parallel rank left without samples by an
    uneven split) is reshaped instead, since paddle's view kernel refuses 0-element results."""
    if paddle.in_dynamic_mode() and 0 in list(x.shape):
        return paddle.reshape(x, shape_or_dtype)
    return x.view(shape_or_dtype)


def squeeze_to(x, axis=None, name=None, *, shape):
    """``squeeze`` on a shard: a reshape to the rank's output shape (a kept dim split down to one row stays)."""
    return paddle.reshape(x, shape)


def reshape_to(x, *args, shape, **kwargs):
    """A shape op (flatten) on a shard as a reshape to the rank's output shape: the op's own local call
    would merge a sharded size-1 dim's empty shard differently from the layout its rule declares."""
    return paddle.reshape(x, shape)


def cdist(x, y, p=2.0, compute_mode="use_mm_for_euclid_dist_if_necessary", name=None):
    """``paddle.cdist`` on shards; a rank holding no row of ``x`` or ``y`` (an uneven split) gets its empty block of
    distances from the broadcast difference, since paddle's kernel drops the batch dims of an empty result."""
    if 0 not in list(x.shape) + list(y.shape):
        return paddle.cdist(x, y, p=p, compute_mode=compute_mode)
    diff = (x.unsqueeze(-2) - y.unsqueeze(-3)).abs()
    return diff.pow(p).sum(-1).pow(1.0 / p) if p > 0 else (diff > 0).astype(x.dtype).sum(-1)


def einsum_diagonals(equation, *operands):
    """``paddle.einsum`` of an equation repeating a label inside one operand (``"ii->i"``, ``"bii,bj->bij"``), on
    shards holding those dims whole: each diagonal taken with ``paddle.diagonal``, then the einsum of the rewritten
    equation (``spmd_rules.einsum.diagonal_steps``). paddle 3.3's einsum fails on a repeated label leading its term
    (``"iij->ij"``); this form does not."""
    from spmd_rules.einsum import diagonal_steps

    ops = list(operands)
    steps, rewritten = diagonal_steps(equation, [len(t.shape) for t in ops])
    for i, a1, a2 in steps:
        ops[i] = paddle.diagonal(ops[i], 0, a1, a2)
    return paddle.einsum(rewritten, *ops)


def fill_diagonal(x, value, offset=0, wrap=False, name=None):
    """paddle's in-place ``x.fill_diagonal_(value, offset, wrap)`` on a copy of the (whole) local tensor: the
    caller's tensor takes the result, and a gradient flows to the cells left unfilled."""
    y = x.clone()
    y.fill_diagonal_(value, offset, wrap)
    return y


def as_strided(x, shape, stride, offset=0, name=None):
    """``paddle.as_strided`` on a copy of the (whole) local tensor: paddle's kernel reads the tensor's storage from
    its holder, so a local tensor that is a view into a larger buffer (a slice kept by a reshard, a Partial term)
    gave other elements (garbage up to 1e+307 in the rule check); the copy's storage is the tensor's row-major
    elements, as one process's contiguous tensor is."""
    return paddle.as_strided(x.clone(), shape, stride, offset)


def histogram_shard(input, bins=100, min=0.0, max=0.0, weight=None, density=False, name=None):
    """``paddle.histogram`` of one shard (a Partial(sum) term of the whole tensor's counts over an explicit range);
    an empty shard (4 rows over 3 ranks: 2, 2, 0) gives zero counts of paddle's dtype, where paddle 3.3's kernel
    returned float64 for an empty input."""
    if 0 not in list(input.shape):
        return paddle.histogram(input, bins, min, max, weight, density)
    # not joined to the inputs: paddle's histogram gives no gradient (its output has stop_gradient=True), and a rank
    # whose weight alone got one would hold a gradient where the other ranks hold None (their collectives on it
    # would then not match: gloo's "op.preamble.length <= op.nbytes" abort in tests/test_diag_ops_dist.py)
    return paddle.zeros([bins], dtype="float32" if weight is not None or density else "int64")


def multiplex_rows(inputs, index, name=None):
    """``paddle.multiplex`` on one rank's rows; a rank holding no row (5 rows over 4 ranks: 2, 2, 1, 0) gets its
    empty block joined to every input, since paddle 3.3's multiplex backward divides by the row count (SIGFPE)."""
    if index.shape[0] != 0:
        return paddle.multiplex(inputs, index)
    out = inputs[0] * 0
    for t in inputs[1:]:
        out = out + t * 0
    return out


def fill_diagonal_tensor_shard(x, y, offset=0, dim1=0, dim2=1, name=None, *, axis1=None, axis2=None):
    """``fill_diagonal_tensor`` / ``diagonal_scatter`` on one rank's shard (the diagonal dims whole); an empty shard
    (a kept dim split unevenly: 3 rows over 4 ranks) is returned as it is, since paddle 3.3's kernel segfaults
    (CalMatDims) on an empty x whose diagonal dims are not the trailing ones. ``y`` is not joined: paddle gives it
    no gradient on any rank, and one rank holding a gradient where the others hold None breaks their collectives."""
    dim1, dim2 = (dim1 if axis1 is None else axis1), (dim2 if axis2 is None else axis2)
    if 0 not in list(x.shape):
        return paddle.Tensor.fill_diagonal_tensor(x, y, offset, dim1, dim2)
    return x * 1


def _empty_joined(shape, x):
    """An empty result of ``shape`` for an empty shard ``x``, joined to it so its gradient is defined (an empty
    tensor, where paddle 3.3's ``vander`` of an empty vector left it undefined)."""
    out = paddle.zeros(shape, dtype=x.dtype)
    return out + (x.sum() * 0).astype(out.dtype) if not x.stop_gradient else out


def vander(x, n=None, increasing=False, name=None):
    """``paddle.vander`` of a shard of the vector; an empty shard: _empty_joined."""
    if x.shape[0] != 0:
        return paddle.vander(x, n, increasing)
    return _empty_joined([0, x.shape[0] if n is None else n], x)


def unfold_windows(x, axis, size, step, name=None):
    """``x.unfold(axis, size, step)`` on a shard (the windowed axis whole); an empty shard (a kept dim split
    unevenly): _empty_joined."""
    if 0 not in list(x.shape):
        return paddle.Tensor.unfold(x, axis, size, step)
    a = axis % len(x.shape)
    return _empty_joined([((n - size) // step + 1) if d == a else n for d, n in enumerate(x.shape)] + [size], x)


PER_RANK = {"vander": vander, "unfold_windows": unfold_windows,
            "fill_diagonal_tensor_shard": fill_diagonal_tensor_shard, "multiplex_rows": multiplex_rows,
            "histogram_shard": histogram_shard, "einsum_diagonals": einsum_diagonals, "fill_diagonal": fill_diagonal,
            "as_strided": as_strided, "cdist": cdist, "reshape_to": reshape_to, "vocab_parallel_embedding": vocab_parallel_embedding, "global_mean": global_mean,
            "row_of_shard": row_of_shard, "setitem": setitem, "view_shape": view_shape, "squeeze_to": squeeze_to,
            "gather_slice": gather_slice}


# ---- group ops: fn(mesh, calls: {rank: (args, kwargs)}) -> {rank: output} -----------------------------
_mesh_reduce = mesh_reduce


def sharded_dropout(mesh, calls):
    """Dropout drawing ONE mask for the global shape (as a single process would) and keeping each rank's
    slice: sharded and replicated runs give the single-process values for the same seed."""
    from autoparallel.rng_agree import agreed_generator

    any_args, any_kwargs = next(iter(calls.values()))
    names = ["x", "p", "axis", "training", "inplace", "mode", "name"]      # paddle.nn.functional.dropout's order
    b = dict(zip(names, any_args))
    b.update(any_kwargs)
    p, training, mode = b.get("p", 0.5), b.get("training", True), b.get("mode", "upscale_in_train")
    if not training or p == 0.0:
        return {r: _x_of(a, k) for r, (a, k) in calls.items()}
    with paddle.no_grad(), agreed_generator(mesh):
        mask = F.dropout(paddle.ones(b["global_shape"], dtype="float32"), p=p, axis=b.get("axis"),
                         training=True, mode=mode)
    out = {}
    for r, (args, kw) in calls.items():
        bb = dict(zip(names, args))
        bb.update(kw)
        m = mask[tuple(slice(a0, a1) for a0, a1 in bb["local_slices"])]
        out[r] = bb["x"] * m.astype(bb["x"].dtype)
    return out


_BN_NAMES = ["x", "running_mean", "running_var", "weight", "bias", "training", "momentum", "epsilon",
             "data_format", "use_global_stats", "name"]           # paddle.nn.functional.batch_norm's order


def sync_batch_norm(mesh, calls):
    """Batch norm in training mode with the batch (or a spatial dim) sharded: per-channel mean and (biased)
    variance over the WHOLE tensor, from sums all-reduced over ``stat_mesh_dims`` (two passes: the mean, then
    the squared deviations), as one process computes them; running stats updated as paddle does
    (``momentum * running + (1 - momentum) * batch``, biased variance) on every held rank."""
    bound = {}
    for r, (args, kwargs) in calls.items():
        b = dict(zip(_BN_NAMES, args))
        b.update(kwargs)
        bound[r] = b
    any_b = next(iter(bound.values()))
    dims = any_b["stat_mesh_dims"]
    fmt = any_b.get("data_format", "NCHW")
    momentum, eps = any_b.get("momentum", 0.9), any_b.get("epsilon", 1e-5)
    nd = any_b["x"].ndim
    c = 1 if fmt.startswith("NC") else nd - 1
    axes = [d for d in range(nd) if d != c]
    view = [1] * nd
    view[c] = -1
    xs = {r: b["x"] for r, b in bound.items()}
    with paddle.no_grad():
        counts = _mesh_reduce({r: paddle.to_tensor(float(x.numel()) / x.shape[c]) for r, x in xs.items()},
                              mesh, dims)
    sums = _stat_sum({r: x.sum(axis=axes) for r, x in xs.items()}, mesh, dims)
    mean = {r: sums[r] / counts[r] for r in xs}
    dev = {r: xs[r] - mean[r].reshape(view) for r in xs}
    sq = _stat_sum({r: (d * d).sum(axis=axes) for r, d in dev.items()}, mesh, dims)
    var = {r: sq[r] / counts[r] for r in xs}
    out = {}
    for r, b in bound.items():
        y = dev[r] / paddle.sqrt(var[r] + eps).reshape(view)
        if b.get("weight") is not None:
            y = y * b["weight"].reshape(view)
        if b.get("bias") is not None:
            y = y + b["bias"].reshape(view)
        out[r] = y
        with paddle.no_grad():
            for name, batch in (("running_mean", mean[r]), ("running_var", var[r])):
                run = b.get(name)
                if run is not None:
                    run.set_value(run * momentum + batch.detach().astype(run.dtype) * (1.0 - momentum))
    return out


def _x_of(args, kwargs):
    return args[0] if args else kwargs["x"]


GROUP = {"vocab_parallel_cross_entropy": vocab_parallel_cross_entropy,
         "global_mean_cross_entropy": global_mean_cross_entropy,
         "sharded_dropout": sharded_dropout, "sync_batch_norm": sync_batch_norm,
         "sharded_masked_scatter": sharded_masked_scatter, "sharded_attention_dropout": sharded_attention_dropout}
