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
"""
from __future__ import annotations

import paddle

FORWARD = ("F", "SEND_F", "RECV_F")


def eval_batch(pipe, inputs, labels=None, compute_loss=None):
    compute_loss = labels is not None if compute_loss is None else bool(compute_loss)
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
    return paddle.concat([_whole(o) for o in st.outputs], axis=0)


def _whole(out):
    from autoparallel.dist_tensor import is_dist

    return out.full() if is_dist(out) else out
