"""Composite ops (see composites.py) of ``paddle.metric``.

``paddle.metric.accuracy`` calls paddle's legacy ``accuracy`` C op (no rule: it counts one rank's rows): on
distributed logits it runs as ``topk`` + ``equal`` + ``sum`` (each routed), so logits split over the batch, over
the classes (vocab parallel) or replicated give one process's accuracy; ``correct`` / ``total`` receive the
counts as paddle writes them (int32 scalars). ``Accuracy.compute`` / ``update`` are written over routed ops and
need nothing. ``Precision`` / ``Recall`` / ``Auc.update`` count on the host (numpy) over the whole mini-batch:
their distributed arguments are read whole first, as one process reads them.
"""
from __future__ import annotations

from spmd_rules.composites import _p, gshape

_INT_LABELS = ("int32", "int64")


def _check_accuracy(input, label, k):
    shape, lshape = gshape(input), gshape(label)
    if len(shape) != 2:
        raise ValueError(f"accuracy: input must be 2-D [sample_number, class_dim], got shape {shape}")
    if len(lshape) != 2 or lshape[1] != 1:
        raise ValueError(f"accuracy: label must be [sample_number, 1], got shape {lshape}")
    if lshape[0] != shape[0]:
        raise ValueError(f"accuracy: input and label must have the same number of rows, got input {shape} and "
                         f"label {lshape}")
    if str(label.dtype).split(".")[-1] not in _INT_LABELS:
        raise TypeError(f"accuracy: label must be int32 or int64, got {label.dtype}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= shape[1]:
        raise ValueError(f"accuracy: k must be an int in [1, {shape[1]}] (the class_dim of input {shape}), got {k!r}")


def _write_count(dst, value) -> None:
    """paddle's accuracy overwrites ``correct`` / ``total`` with int32 scalars."""
    paddle = _p()
    if dst is None:
        return
    if hasattr(dst, "placements") and hasattr(dst, "full"):
        raise NotImplementedError("accuracy: correct / total given as distributed tensors; pass plain tensors "
                                  "(paddle overwrites them with int32 scalars) or None")
    if not isinstance(value, int):
        value = int(value.full().numpy()) if hasattr(value, "full") else int(value.numpy())
    paddle.assign(paddle.to_tensor(value, dtype="int32"), output=dst)


def accuracy(input, label, k=1, correct=None, total=None, name=None):
    """paddle.metric.accuracy: the fraction of rows whose label is among the row's ``k`` largest logits
    (float32, no gradient). A negative label never matches (one process raises on it: reading the labels to
    check would cost a collective)."""
    paddle = _p()
    _check_accuracy(input, label, k)
    n = gshape(input)[0]
    with paddle.no_grad():
        _, idx = paddle.topk(input.detach(), k=k, axis=-1)
        hits = (idx == label.detach().astype(idx.dtype)).astype("int32").sum()    # topk indices are distinct
        acc = hits.astype("float32") / float(max(n, 1))
    _write_count(correct, hits)
    _write_count(total, n)
    return acc


def _whole(v):
    """A distributed argument as its global value (a plain tensor); anything else as it is."""
    return v.full() if hasattr(v, "placements") and hasattr(v, "full") else v


def _host_update(cls_name):
    def update(self, preds, labels):
        cls = getattr(_p().metric, cls_name)
        orig = cls.update
        while getattr(orig, "_ap_wrapper", False):
            orig = orig.__wrapped__
        return orig(self, _whole(preds), _whole(labels))

    update.__name__ = "update"
    return update


COMPOSITES: dict = {"paddle.metric.accuracy": accuracy,
                    **{f"paddle.metric.{c}.update": _host_update(c) for c in ("Precision", "Recall", "Auc")}}
