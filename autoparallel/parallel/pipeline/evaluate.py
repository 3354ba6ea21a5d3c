"""Evaluation through a pipeline: forward only, no gradient, no backward.

    pipe.eval()                                   # dropout off, as model.eval() in one process
    loss = pipe.eval_batch(ids, labels)           # the mean loss, on every rank (as train_batch)
    logits = pipe.eval_batch(ids)                 # the last stage's output, on its ranks (None elsewhere)
    pipe.train()

Every rank runs the forward actions of its schedule (``F``, ``SEND_F``, ``RECV_F``: a sub-list of every rank's
list keeps the one global order, so it cannot deadlock) under ``paddle.no_grad()``; nothing is saved for a
backward and no gradient changes, so a train step after it runs as if the evaluation never happened. The loss
is weighted as in ``train_batch`` (batch.py), so it equals one process's loss on the whole batch. Without labels
the outputs of the micro-batches are concatenated along the batch dim (gathered whole when the last stage
holds them distributed). ``compute_loss`` (default: whether ``labels`` were given) must be the same on every
rank: a model with ``embed()``/``head()`` lets ranks between the first and last stage pass ``None`` for both, so
they must say ``compute_loss=True`` when the others pass labels.

A batch that does not divide into micro_batches x data-parallel degree (the last batch of an eval set) is padded
to the next multiple, labels with -100, and outputs cut back: the default loss equals one process's over the real
samples. A custom loss_fn is refused there (it would count the padded samples).
"""
from __future__ import annotations

import paddle

FORWARD = ("F", "SEND_F", "RECV_F")


def eval_batch(pipe, inputs, labels=None, compute_loss=None):
    from .batch import labels_from_inputs

    inputs, labels = labels_from_inputs(inputs, labels, "eval_batch")
    compute_loss = labels is not None if compute_loss is None else bool(compute_loss)
    inputs, labels, n = _padded(pipe, inputs, labels, compute_loss)
    with paddle.no_grad():
        st = pipe._step_state(inputs, labels, need_labels=compute_loss)
        handlers = {"F": pipe._forward, "SEND_F": pipe._send_f, "RECV_F": pipe._recv_f}
        with pipe._step_guard():
            for _, a in pipe._program(keep=FORWARD):
                pipe._run(handlers[a.kind], a, st)
    if pipe.transport.pending():
        raise RuntimeError("eval_batch ended with undelivered transfers; the action lists are inconsistent")
    if compute_loss:
        loss = st.loss if pipe.holds_last else None
        return pipe._sync_loss(loss) if pipe._sync_loss is not None else loss
    if not pipe.holds_last:
        return None
    out = paddle.concat([_whole(o) for o in st.outputs], axis=0)
    return out if n is None else out[:n]


def _samples(batch):
    from .batch import _is_array, rows

    if isinstance(batch, dict):
        return rows(batch)
    return int(batch.shape[0]) if _is_array(batch) and len(batch.shape) else None


def _pad(batch, extra: int, value):
    """``batch`` (a tensor, array or dict of them) with ``extra`` samples of ``value`` appended along dim 0."""
    from .batch import _is_array, _tensor, broadcast_keys

    if isinstance(batch, dict):
        whole = broadcast_keys(batch)
        return {k: _pad(v, extra, value) if _is_array(v) and k not in whole else v for k, v in batch.items()}
    if not _is_array(batch):
        return batch
    t = _tensor(batch)
    return paddle.concat([t, paddle.full([extra] + list(t.shape[1:]), value, dtype=t.dtype)], axis=0)


def _padded(pipe, inputs, labels, compute_loss):
    """A last eval batch that does not divide into micro_batches x data-parallel degree (one process runs it) is
    padded to the next multiple: inputs with zeros, labels with -100 (the default loss skips them, so the mean
    is the one-process loss over the real samples); outputs are cut back to the real samples. A custom loss_fn
    would count padded samples: refused with what to do. (inputs, labels, real samples or None)."""
    import sys

    from .batch import IGNORE_INDEX

    default_loss = getattr(sys.modules[type(pipe).__module__], "_cross_entropy", None)   # the runtime's, unimported
    m, dp = pipe.plan.micro_batches, pipe._dp()
    n = _samples(inputs) if inputs is not None else _samples(labels)
    if n is None or n % (m * dp) == 0 or isinstance(inputs, (list, tuple)) or isinstance(labels, (list, tuple)):
        return inputs, labels, None
    if compute_loss and pipe.loss_fn is not default_loss:
        raise ValueError(f"eval_batch: the batch ({n} samples) does not divide into micro_batches x data-parallel "
                         f"degree = {m} x {dp}, and a custom loss_fn cannot be evaluated on padded samples; pass "
                         f"batches of a multiple of {m * dp} samples (DataLoader(drop_last=True)), or evaluate "
                         f"the last one with labels padded by -100 under the default loss")
    extra = m * dp - n % (m * dp)
    return _pad(inputs, extra, 0), (_pad(labels, extra, IGNORE_INDEX) if labels is not None else None), n


def _whole(out):
    from autoparallel.dist_tensor import is_dist

    return out.full() if is_dist(out) else out
