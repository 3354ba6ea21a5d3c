"""A pipeline step's batch: its micro-batches and the weight of each micro-batch's loss.

``split(batch, m, dp, what)`` cuts the global batch of a step into ``m`` equal micro-batches. A batch is

* a tensor (or array): cut along its first dim; it must divide into ``m x dp`` equal parts;
* a dict of the model's keyword inputs (``{"input_ids": ids, "attention_mask": mask, "position_ids": pos}``):
  every tensor value cut along its first dim (all must hold the same number of samples), other values (``None``,
  flags) passed to every micro-batch as given; the model is called as ``model(**inputs)``;
* a list / tuple with one entry (tensor or dict) per micro-batch, already cut.

A dict holding ``"labels"`` (a data collator's batch) gives the step's labels (``labels_from_inputs``).

Loss weights. The default loss is the mean cross-entropy over the tokens whose label is not ``-100`` across
the whole global batch, which is what the PaddleFormers causal LMs compute (``model(input_ids=...,
labels=...).loss``), whatever the micro-batching: each micro-batch's summed cross-entropy
(``reduction="sum"``, the same value for plain and distributed logits) divided by the labels not ``-100`` in
the step. (Paddle's ``F.cross_entropy`` mean divides by every label, ignored ones included, when
``ignore_index`` is negative: pass ``loss_fn=F.cross_entropy`` for that.) A user ``loss_fn`` is a
per-micro-batch mean: weight ``1 / m`` (exact when the loss is a mean over equally many terms in every
micro-batch).
"""
from __future__ import annotations

import numpy as np
import paddle

from autoparallel.parallel.input_sharding import refuse_guard as _refuse_guard


def refuse_guard(where: str) -> None:
    """A step cuts its batch itself: an ``ap.parallel_guard`` other than the default would be ignored (raises)."""
    _refuse_guard(where)


IGNORE_INDEX = -100


def _tensor(x):
    return x if isinstance(x, paddle.Tensor) else paddle.to_tensor(np.asarray(x))


def _is_array(x) -> bool:
    return isinstance(x, (paddle.Tensor, np.ndarray))


def _check_plain(batch, what: str) -> None:
    from autoparallel.dist_tensor import is_dist

    values = list(batch.values()) if isinstance(batch, dict) else \
        list(batch) if isinstance(batch, (list, tuple)) else [batch]
    for v in values:
        inner = list(v.values()) if isinstance(v, dict) else [v]
        if any(is_dist(t) for t in inner):
            raise TypeError(f"train_batch {what}: expected the global batch as plain tensors or arrays (the same on "
                            f"every rank; the pipeline places micro-batches on the stage meshes), got a distributed "
                            f"tensor")


def split(batch, m: int, dp: int, what: str) -> list:
    """``m`` micro-batches of ``batch`` (module docstring); ValueError / TypeError naming what is wrong."""
    if batch is None:
        raise ValueError(f"this process runs the {'first' if what == 'inputs' else 'last'} pipeline stage, "
                         f"so train_batch needs the {what}; got None")
    _check_plain(batch, what)
    if what == "inputs":
        refuse_loss_flags(batch)
    if isinstance(batch, (list, tuple)):
        if len(batch) != m:
            raise ValueError(f"train_batch {what}: a list or tuple is read as one tensor per micro-batch ({m}), got "
                             f"{len(batch)}; pass model keyword inputs (ids and an attention mask) as a "
                             f"dict, e.g. {{'input_ids': ids, 'attention_mask': mask}}")
        parts = [{k: _tensor(v) if _is_array(v) else v for k, v in b.items()} if isinstance(b, dict) else _tensor(b)
                 for b in batch]
    elif isinstance(batch, dict):
        parts = _split_dict(batch, m, dp, what)
    else:
        parts = paddle.split(_checked(_tensor(batch), m, dp, what), m, axis=0)
    shapes = {_shape_key(p) for p in parts}
    if len(shapes) != 1:
        raise ValueError(f"train_batch {what}: micro-batches must share one shape, got {sorted(shapes, key=str)}")
    return parts


def refuse_loss_flags(batch) -> None:
    """A model keyword input that makes the model add loss terms of its own (``output_router_logits=True``: a MoE
    router's load-balancing loss, added to the loss it computes from labels) is refused on every rank before any
    transfer: the pipeline computes the loss from the logits alone and would drop them silently (the flag in the
    config is refused when the pipeline is built, ``auto_split.refuse_model_losses``)."""
    dicts = [batch] if isinstance(batch, dict) else \
        [b for b in batch if isinstance(b, dict)] if isinstance(batch, (list, tuple)) else []
    for d in dicts:
        v = d.get("output_router_logits")
        if v is not None and not _is_array(v) and bool(v):
            raise NotImplementedError(f"model input output_router_logits={v!r}: the model would add its router's "
                                      f"load-balancing loss to the loss it computes from labels (and return the "
                                      f"router logits), while a pipeline computes the loss from the logits alone, so "
                                      f"the auxiliary loss would be silently dropped; leave output_router_logits "
                                      f"unset or False")


def labels_from_inputs(inputs, labels, call: str):
    """``(inputs, labels)`` of a step whose model inputs may carry the labels, as a data collator's batch does
    (``{"input_ids": ..., "attention_mask": ..., "labels": ...}``): the labels are taken out of the dict (the stages
    would otherwise pass them to the model, whose loss output would be read as its logits). Labels given both
    ways raise ``ValueError``."""
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(b, dict) and "labels" in b for b in inputs):
        pairs = [labels_from_inputs(b, None, call) for b in inputs]
        inner = [y for _, y in pairs]
        inputs, found = type(inputs)(b for b, _ in pairs), None if all(y is None for y in inner) else inner
    elif isinstance(inputs, dict) and "labels" in inputs:
        found = inputs["labels"]
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
    else:
        return inputs, labels
    if found is not None and labels is not None:
        raise ValueError(f"{call}: the labels were given twice, as the labels argument and as inputs['labels']; "
                         f"expected one of them (e.g. {call}(batch) with the collator's dict, or "
                         f"{call}(inputs, labels) with a dict without 'labels')")
    return inputs, labels if found is None else found


def _checked(t, m: int, dp: int, what: str, call: str = "train_batch"):
    n = int(t.shape[0]) if t.ndim else 0
    if t.ndim == 0 or n % (m * dp):
        raise ValueError(f"{call} {what}: the global batch ({n} samples) must divide into "
                         f"micro_batches x data-parallel degree = {m} x {dp} equal parts (a batch of a multiple of "
                         f"{m * dp} samples, e.g. drop_last=True in the data loader, or "
                         f"pipeline_parallel.micro_batches dividing the batch)")
    return t


def rows(batch: dict) -> int | None:
    """The samples of a dict of model inputs: the largest first dim of its tensors (None without one)."""
    dims = [int(v.shape[0]) for v in batch.values() if _is_array(v) and len(v.shape)]
    return max(dims) if dims else None


def broadcast_keys(batch: dict) -> set:
    """Keys of a dict of model inputs whose tensor has first dim 1 while others hold several samples (position ids
    of shape ``[1, seq]``, broadcast over the batch by the model): passed whole to every micro-batch, replicated."""
    n = rows(batch)
    return {k for k, v in batch.items() if n and n > 1 and _is_array(v) and len(v.shape) and int(v.shape[0]) == 1}


def place_dict(batch: dict, mesh, boundary: list) -> dict:
    """A micro-batch of model keyword inputs on a stage's mesh: tensors in the boundary layout (cut over the data
    ranks), broadcast ones (``broadcast_keys``) replicated, other values as given."""
    from autoparallel.dist_tensor import shard_tensor
    from autoparallel.placement import Replicate

    whole = broadcast_keys(batch)
    return {k: shard_tensor(v, mesh, [Replicate()] * mesh.ndim if k in whole else boundary)
            if isinstance(v, paddle.Tensor) else v for k, v in batch.items()}


def _split_dict(batch: dict, m: int, dp: int, what: str) -> list:
    if not batch or not all(isinstance(k, str) for k in batch):
        raise TypeError(f"train_batch {what}: a dict must map the model's keyword argument names to inputs, got "
                        f"keys {list(batch)}")
    whole = broadcast_keys(batch)
    tensors = {k: _checked(_tensor(v), m, dp, f"{what}[{k!r}]") for k, v in batch.items()
               if _is_array(v) and k not in whole}
    sizes = {k: int(t.shape[0]) for k, t in tensors.items()}
    if not tensors or len(set(sizes.values())) != 1:
        raise ValueError(f"train_batch {what}: every tensor of the dict is cut into micro-batches along its first "
                         f"dim, so they must hold one number of samples; got {sizes}")
    cut = {k: paddle.split(t, m, axis=0) for k, t in tensors.items()}
    return [{k: cut[k][i] if k in cut else _tensor(v) if k in whole else v for k, v in batch.items()}
            for i in range(m)]


def _shape_key(part):
    if isinstance(part, dict):
        return tuple(sorted((k, tuple(v.shape)) for k, v in part.items() if isinstance(v, paddle.Tensor)))
    return tuple(part.shape)


def check_samples(inputs: list, labels: list) -> None:
    """Inputs and labels micro-batches hold the same number of samples (a tuple of model inputs passed where
    micro-batches are expected does not)."""
    def samples(p):
        if isinstance(p, dict):
            return rows(p)
        return int(p.shape[0]) if p.ndim else None

    a, b = samples(inputs[0]), samples(labels[0])
    if a is not None and b is not None and a != b:
        raise ValueError(f"train_batch: each micro-batch of the inputs holds {a} samples but each of the labels {b}; "
                         f"they must match (a list or tuple is read as one entry per micro-batch: pass several model "
                         f"inputs as a dict)")


def loss_weights(labels: list, default_loss: bool) -> list:
    """The factor of each micro-batch's loss (module docstring)."""
    m = len(labels)
    if not default_loss:
        return [1.0 / m] * m
    valid = sum(int((np.asarray(t.numpy()) != IGNORE_INDEX).sum()) for t in labels)
    return [1.0 / max(valid, 1)] * m


def summed_cross_entropy(logits, labels):
    """The default loss of a micro-batch before its weight: cross-entropy summed over the labels not -100."""
    import paddle.nn.functional as F

    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def check_labels(logits_shape, labels_shape, default_loss: bool) -> None:
    """The default loss needs one label per logit row: the logits' shape without the class dim."""
    if default_loss and list(labels_shape) not in (list(logits_shape[:-1]), list(logits_shape[:-1]) + [1]):
        raise ValueError(f"train_batch labels: a micro-batch of labels has shape {list(labels_shape)}, but the model's "
                         f"logits for it have shape {list(logits_shape)}; the default cross-entropy needs labels of "
                         f"shape {list(logits_shape[:-1])} (the logits' shape without the class dim)")
