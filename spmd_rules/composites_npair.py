"""Composite op (see composites.py): ``F.npair_loss``, paddle's own formula with its private
``base_softmax_with_cross_entropy`` (an unrouted C op) replaced by the public ``F.cross_entropy``
with soft labels, which has a rule."""
from __future__ import annotations

from spmd_rules.composites import _F, _p, gshape


def npair_loss(anchor, positive, labels, l2_reg=0.002):
    paddle, F = _p(), _F()
    if 0 in gshape(anchor) or 0 in gshape(positive):
        raise ValueError("npair_loss: anchor and positive must not be empty, got shapes "
                         f"{gshape(anchor)} and {gshape(positive)}")
    n = gshape(labels)[0]
    labels = paddle.tile(paddle.reshape(labels, [n, 1]), repeat_times=[1, n])
    labels = paddle.equal(labels, paddle.transpose(labels, perm=[1, 0])).astype("float32")
    labels = labels / paddle.sum(labels, axis=1, keepdim=True)
    l2loss = paddle.mean(paddle.sum(paddle.square(anchor), 1)) + paddle.mean(paddle.sum(paddle.square(positive), 1))
    l2loss = l2loss * 0.25 * l2_reg
    similarity = paddle.matmul(anchor, positive, transpose_x=False, transpose_y=True)
    softmax_ce = F.cross_entropy(similarity, labels, soft_label=True, reduction="none")
    return l2loss + paddle.mean(paddle.sum(labels * softmax_ce, 0))


COMPOSITES: dict = {"paddle.nn.functional.npair_loss": npair_loss}
