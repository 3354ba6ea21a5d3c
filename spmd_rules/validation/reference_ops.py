"""Reference implementations of the purely local ``local_op``s a rule may name."""
from __future__ import annotations

from .local_arrays import _paddle


def _vocab_parallel_embedding(x, weight, padding_idx=None, max_norm=None, norm_type=2.0, sparse=False,
                              scale_grad_by_freq=False, name=None, *, vocab_start, vocab_end, vocab_size=None):
    paddle = _paddle()
    F = paddle.nn.functional
    mask = (x >= vocab_start) & (x < vocab_end)
    ids = paddle.where(mask, x - vocab_start, paddle.zeros_like(x))
    out = F.embedding(ids, weight, padding_idx=padding_idx, sparse=sparse)
    return out * mask.unsqueeze(-1).astype(out.dtype)


def _global_mean(x, axis=None, keepdim=False, name=None, *, global_count, dtype=None):
    paddle = _paddle()
    return paddle.sum(x, axis=axis, dtype=dtype, keepdim=keepdim) / global_count


def _row_of_shard(x, index=None, *, row):
    from autoparallel.local_ops import row_of_shard

    return row_of_shard(x, index, row=row)


def _setitem(x, index, value):
    from autoparallel.local_ops import setitem

    return setitem(x, index, value)


def _cdist(x, y, p=2.0, compute_mode="use_mm_for_euclid_dist_if_necessary", name=None):
    from autoparallel.local_ops import cdist

    return cdist(x, y, p, compute_mode)


def _einsum_diagonals(equation, *operands):
    from autoparallel.local_ops import einsum_diagonals

    return einsum_diagonals(equation, *operands)


def _fill_diagonal(x, value, offset=0, wrap=False, name=None):
    from autoparallel.local_ops import fill_diagonal

    return fill_diagonal(x, value, offset, wrap)


def _as_strided(x, shape, stride, offset=0, name=None):
    from autoparallel.local_ops import as_strided

    return as_strided(x, shape, stride, offset)


def _histogram_shard(input, bins=100, min=0.0, max=0.0, weight=None, density=False, name=None):
    from autoparallel.local_ops import histogram_shard

    return histogram_shard(input, bins, min, max, weight, density)


def _multiplex_rows(inputs, index, name=None):
    from autoparallel.local_ops import multiplex_rows

    return multiplex_rows(inputs, index)


def _fill_diagonal_tensor_shard(x, y, offset=0, dim1=0, dim2=1, name=None, **kw):
    from autoparallel.local_ops import fill_diagonal_tensor_shard

    return fill_diagonal_tensor_shard(x, y, offset, dim1, dim2, **kw)


def _unfold_windows(x, axis, size, step, name=None):
    from autoparallel.local_ops import unfold_windows

    return unfold_windows(x, axis, size, step)


def _vander(x, n=None, increasing=False, name=None):
    from autoparallel.local_ops import vander

    return vander(x, n, increasing)


def _squeeze_to(x, axis=None, name=None, *, shape):
    return _paddle().reshape(x, shape)


def _reshape_to(x, *args, shape, **kwargs):
    return _paddle().reshape(x, shape)


LOCAL_OPS = {
    "squeeze_to": _squeeze_to,
    "reshape_to": _reshape_to,
    "setitem": _setitem,
    "vocab_parallel_embedding": _vocab_parallel_embedding,
    "global_mean": _global_mean,
    "row_of_shard": _row_of_shard,
    "cdist": _cdist,
    "einsum_diagonals": _einsum_diagonals,
    "fill_diagonal": _fill_diagonal,
    "as_strided": _as_strided,
    "histogram_shard": _histogram_shard,
    "multiplex_rows": _multiplex_rows,
    "fill_diagonal_tensor_shard": _fill_diagonal_tensor_shard,
    "unfold_windows": _unfold_windows,
    "vander": _vander,
}
