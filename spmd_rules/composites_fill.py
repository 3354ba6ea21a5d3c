"""Composite ops (see composites.py): paddle's in-place random fills ``uniform_``, ``normal_``, ``exponential_``,
``cauchy_``, ``log_normal_``, ``bernoulli_``, ``geometric_`` on a distributed tensor (``w.uniform_(-a, a)`` in a
model's own init). One draw for the global shape, by paddle's own in-place op on a plain tensor of that shape (the
generator advances as one process's does, so the values equal a single process's for the same seed), then written
into the tensor with ``x[...] = value`` (each rank keeps its part of it). And the draws that read a distributed
tensor's values (``bernoulli``, ``poisson``, ``standard_gamma``, ``binomial``, ``normal`` / ``log_normal`` with tensor
mean or std): one draw from the whole value, laid out like that tensor (the convention of ``rand_like``)."""
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


# ---- draws reading a distributed tensor's values: one draw from the whole value, laid out like the tensor ----------
def _is_dist(v) -> bool:
    return hasattr(v, "full") and hasattr(v, "placements")


def _laid_like(x, value):
    """The plain global ``value`` laid out like the distributed ``x`` (Partial -> R), needing no gradient."""
    out = _p().zeros_like(x, dtype=str(value.dtype).replace("paddle.", "")) + value
    out.stop_gradient = True
    return out


def _draw_like(x, draw):
    with _p().no_grad():
        value = draw(_whole(x).detach())
    return _laid_like(x, value)


def bernoulli(x, p=None, name=None):
    return _draw_like(x, lambda v: _p().bernoulli(v, p))


def poisson(x, name=None):
    return _draw_like(x, lambda v: _p().poisson(v))


def standard_gamma(x, name=None):
    return _draw_like(x, lambda v: _p().standard_gamma(v))


def binomial(count, prob, name=None):
    like = count if _is_dist(count) else prob
    with _p().no_grad():
        value = _p().binomial(_whole(count).detach(), _whole(prob).detach())
    return _laid_like(like, value)


def _mean_std_draw(op, mean, std, shape):
    like = mean if _is_dist(mean) else std
    with _p().no_grad():
        value = getattr(_p(), op)(_whole(mean), _whole(std), shape)
    return _laid_like(like, value)


def normal(mean=0.0, std=1.0, shape=None, name=None, *, out=None):
    if out is not None:
        raise NotImplementedError("paddle.normal(out=...) with distributed mean / std is not supported")
    return _mean_std_draw("normal", mean, std, shape)


def log_normal(mean=1.0, std=2.0, shape=None, name=None):
    return _mean_std_draw("log_normal", mean, std, shape)


_NAMES = ("uniform_", "normal_", "exponential_", "cauchy_", "log_normal_", "bernoulli_", "geometric_")
COMPOSITES: dict = {f"paddle.Tensor.{n}": globals()[n] for n in _NAMES}
COMPOSITES.update({f"paddle.{n}": globals()[n] for n in ("bernoulli", "poisson", "standard_gamma", "binomial",
                                                         "normal", "log_normal")})
COMPOSITES.update({f"paddle.{n}": globals()[n] for n in ("normal_", "bernoulli_", "log_normal_", "cauchy_", "geometric_")})
