"""Pieces shared by the example models: causal attention from basic ops, initialisers, parameter counts.

Everything here is plain paddle and reads shapes from the tensors it gets, so it runs unchanged when
those tensors are distributed wrappers whose ``.shape`` is the global shape.
"""
from __future__ import annotations

import math

import paddle
import paddle.nn.functional as F
from paddle import nn


def normal_attr(std: float) -> paddle.ParamAttr:
    """Normal(0, std) initialiser as a ParamAttr, so it also works under ``paddle.LazyGuard``."""
    return paddle.ParamAttr(initializer=nn.initializer.Normal(mean=0.0, std=std))


def causal_attention(q, k, v):
    """Softmax attention with a causal mask. q, k, v: [batch, seq, heads, head_dim] -> same shape."""
    b, t, h, hd = q.shape
    q, k, v = (x.transpose([0, 2, 1, 3]) for x in (q, k, v))          # [b, h, t, hd]
    scores = paddle.matmul(q, k, transpose_y=True) * (1.0 / math.sqrt(hd))
    mask = paddle.triu(paddle.full([t, t], float("-inf"), dtype=scores.dtype), diagonal=1)
    probs = F.softmax(scores + mask, axis=-1)
    return paddle.matmul(probs, v).transpose([0, 2, 1, 3])           # [b, t, h, hd]


def count_parameters(layer: nn.Layer) -> int:
    """Number of scalars in the layer's distinct parameters (a tied weight counts once).

    Uses shapes only, so it works on a model built under ``paddle.LazyGuard`` without allocating it.
    """
    seen, total = set(), 0
    for p in layer.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += math.prod(p.shape)
    return total


class CausalLM(nn.Layer):
    """What the example language models share: the output projection (its own ``lm_head``, or the token
    embedding's transpose when ``config.tie_embeddings``), the loss and the parameter count."""

    def _add_lm_head(self, c) -> None:
        if not c.tie_embeddings:
            self.lm_head = nn.Linear(c.hidden, c.vocab_size, weight_attr=normal_attr(c.init_std), bias_attr=False)

    def logits(self, x, embedding: nn.Embedding):
        """[batch, seq, hidden] -> [batch, seq, vocab]."""
        if self.config.tie_embeddings:
            return paddle.matmul(x, embedding.weight, transpose_y=True)
        return self.lm_head(x)

    @staticmethod
    def loss(logits, labels):
        """Mean token cross-entropy. logits [b, t, vocab], labels [b, t] (int64)."""
        return F.cross_entropy(logits, labels, reduction="mean")

    def num_parameters(self) -> int:
        return count_parameters(self)


def initialize_lazy(layer: nn.Layer) -> nn.Layer:
    """Allocate and initialise the parameters of a model built under ``paddle.LazyGuard``.

    Parameters are initialised in creation order, so ``paddle.seed(s)`` followed by this call gives the
    values an eager build after ``paddle.seed(s)`` would have.
    """
    for p in layer.parameters():
        if hasattr(p, "_is_initialized") and not p._is_initialized():
            p.initialize()
    return layer
