"""softmax and log_softmax: the softmax axis must be whole (R); other dims keep their sharding;
Partial inputs need R."""
from __future__ import annotations

from autoparallel.core.spec import normalize_dtype

from spmd_rules.blocks import block_aware
from spmd_rules.einsum import label_reverse, labels_result
from spmd_rules.expand import expand_reverse
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import check_spec, norm_axis


def _labels(op, x, axis):
    a = norm_axis(op, axis, x.ndim) if x.ndim else None
    return tuple(None if d == a else d for d in range(x.ndim))


def _make(op):
    def rule(x, axis=-1, dtype=None, name=None):
        check_spec(op, "x", x)
        xl = _labels(op, x, axis)
        dt = normalize_dtype(dtype) if dtype is not None else x.dtype
        return labels_result(op, [x], [xl], [xl], [(x.shape, dt)], linear=None)

    def rev(outputs, x, axis=-1, dtype=None, name=None):
        xl = _labels(op, x, axis)
        return SpmdResult(expand_reverse(op, [x], outputs, label_reverse([xl], [xl], linear=None)), outputs)

    rule.__name__ = op
    block_aware(rule)                  # a block-sharded dim other than the axis passes through
    register_spmd_rule(op, rule, reverse=rev)


_make("softmax")
_make("log_softmax")
