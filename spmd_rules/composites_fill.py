"""Composite ops (see composites.py): paddle's in-place random fills ``uniform_``, ``normal_``, ``exponential_``,
``cauchy_``, ``log_normal_``, ``bernoulli_``, ``geometric_`` on a distributed tensor (``w.uniform_(-a, a)`` in a
model's own init). One draw for the global shape, by paddle's own in-place op on a plain tensor of that shape (the
generator advances as one process's does, so the values equal a single process's for the same seed), then written
into the tensor with ``x[...] = value`` (each rank keeps its part of it)."""
from __future__ import annotations

from spmd_rules.composites import _p, gshape

# fills paddle refuses on a leaf that requires a gradient (an inplace-strategy error); the others it accepts
_REFUSED_ON_LEAF = ("uniform_", "normal_")


def _whole(v):
    """A tensor argument (``bernoulli_``'s p, ``geometric_``'s probs) as its global value."""
    return v.full() if hasattr(v, "full") else v


def _fill(op, x, draw):
    paddle = _p()
    dtype = str(x.dtype).replace("paddle.", "")
    with paddle.no_grad():
        value = getattr(paddle.empty(list(gshape(x)), dtype=dtype), op)
        value = draw(value)
    leaf = x.is_leaf if hasattr(x, "is_leaf") else True
    if op in _REFUSED_ON_LEAF or not leaf or x.stop_gradient:
        x[...] = value                     # routed: paddle's refusal of a leaf requiring a gradient holds
    else:
        with paddle.no_grad():             # accepted by paddle on a leaf: the leaf takes the values
            x[...] = value
    return x


def uniform_(x, min=0, max=1.0, seed=0, name=None):
    return _fill("uniform_", x, lambda f: f(min, max, seed))


def normal_(x, mean=0.0, std=1.0, name=None):
    return _fill("normal_", x, lambda f: f(mean, std))


def exponential_(x, lam=1.0, name=None):
    return _fill("exponential_", x, lambda f: f(lam))


def cauchy_(x, loc=0, scale=1, name=None):
    return _fill("cauchy_", x, lambda f: f(loc, scale))


def log_normal_(x, mean=1.0, std=2.0, name=None):
    return _fill("log_normal_", x, lambda f: f(mean, std))


def bernoulli_(x, p=0.5, name=None):
    return _fill("bernoulli_", x, lambda f: f(_whole(p)))


def geometric_(x, probs, name=None):
    return _fill("geometric_", x, lambda f: f(_whole(probs)))


_NAMES = ("uniform_", "normal_", "exponential_", "cauchy_", "log_normal_", "bernoulli_", "geometric_")
COMPOSITES: dict = {f"paddle.Tensor.{n}": globals()[n] for n in _NAMES}
COMPOSITES.update({f"paddle.{n}": globals()[n] for n in ("normal_", "bernoulli_", "log_normal_", "cauchy_", "geometric_")})
