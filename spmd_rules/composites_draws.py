"""Composite ops (see composites.py): activations that draw random numbers inside paddle's C kernel,
``F.gumbel_softmax`` and ``F.rrelu``. The draw is paddle's own kernel run once on a plain tensor of the GLOBAL
shape (the generator advances as one process's does, so the values equal a single process's for the same seed);
the rest is routed ops on the distributed input.

* ``gumbel_softmax``: the kernel run on zeros gives softmax(g), whose log is the noise g up to a constant per
  softmax row, which softmax ignores. The gradient is paddle's kernel's: the softmax Jacobian at the output without
  the 1/temperature factor, and zero for ``hard=True`` (paddle's backward reads the one-hot output).
* ``rrelu``: the kernel draws a slope only for negative inputs, so it runs on the gathered input; each element's
  slope (out / x where x < 0, else 1) then multiplies the distributed input.
"""
from __future__ import annotations

from spmd_rules.composites import _F, _p, gshape


def _dtype(x) -> str:
    return str(x.dtype).replace("paddle.", "")


def _whole(x):
    return x.full() if hasattr(x, "full") else x


def gumbel_softmax(x, temperature=1.0, hard=False, axis=-1, name=None):
    paddle, F = _p(), _F()
    if temperature <= 0:
        raise ValueError(f"gumbel_softmax: temperature must be positive, got {temperature}")
    with paddle.no_grad():
        noise = paddle.log(F.gumbel_softmax(paddle.zeros(gshape(x), dtype=_dtype(x)), 1.0, False, axis))
    scaled = x + ((x + noise) / temperature - x).detach()     # value (x + g) / T, gradient 1 (paddle's kernel)
    soft = F.softmax(scaled, axis=axis)
    if not hard:
        return soft
    with paddle.no_grad():
        index = paddle.argmax(soft, axis=axis, keepdim=True)
        one_hot = paddle.put_along_axis(paddle.zeros_like(soft), index, paddle.to_tensor(1.0, _dtype(x)), axis)
    return one_hot + x * 0.0                                 # paddle's backward of the one-hot output is zero


def rrelu(x, lower=1.0 / 8.0, upper=1.0 / 3.0, training=True, name=None):
    paddle, F = _p(), _F()
    if not 0 <= lower <= upper <= 1:
        raise ValueError(f"rrelu: expected 0 <= lower <= upper <= 1, got lower={lower}, upper={upper}")
    if not training:
        return F.leaky_relu(x, (lower + upper) / 2.0)
    with paddle.no_grad():
        whole = _whole(x).detach()
        drawn = F.rrelu(whole, lower, upper, training=True)
        negative = whole < 0
        slope = paddle.where(negative, drawn / paddle.where(negative, whole, paddle.ones_like(whole)),
                             paddle.ones_like(whole))
    return x * slope


COMPOSITES: dict = {f"paddle.nn.functional.{n}": globals()[n] for n in ("gumbel_softmax", "rrelu")}
