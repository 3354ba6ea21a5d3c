"""Composite ops (see composites.py): paddle's functions that read a tensor's metadata, not its values
(``paddle.shape``, ``paddle.rank``, ``paddle.is_empty``, ``paddle.tolist``) and ``paddle.increment`` (a counter
bumped in place), and ``paddle.histogramdd`` (a count over the whole sample, no gradient: the gathered values,
counted once, replicated) and ``paddle.fft.fftshift`` / ``ifftshift`` (a roll by half of each axis). Model code
reads ``paddle.shape(input_ids)[1]`` for the sequence length; on a distributed tensor these answered nothing (no
spmd rule). Here they answer for the GLOBAL tensor, as ``x.shape`` does, without
communicating, except ``tolist`` (the global values)."""
from __future__ import annotations

import math

from spmd_rules.composites import _p, gshape


def _shape(x) -> list:
    """The shape ``x.shape`` reports: a DistTensor's global one; a DistParameter is a paddle Parameter holding
    this rank's shard, whose ``.shape`` is the shard's (as ``paddle.numel``, composites_more.numel)."""
    paddle = _p()
    return list(x.shape) if isinstance(x, paddle.Tensor) else gshape(x)


def shape(input):
    """The shape as an int64 tensor (paddle 3's dtype of ``paddle.shape``)."""
    return _p().to_tensor(_shape(input), dtype="int64")


def rank(input):
    """The number of dims as a 0-d int32 tensor."""
    return _p().to_tensor(len(_shape(input)), dtype="int32")


def is_empty(x, name=None):
    return _p().to_tensor(math.prod(_shape(x)) == 0)


def tolist(x):
    return x.tolist()


def increment(x, value=1.0, name=None):
    """``x += value`` in place for a one-element tensor (paddle's kernel accepts only those); returns ``x``."""
    if math.prod(gshape(x)) != 1:
        raise ValueError(f"increment: x must have exactly one element, got shape {gshape(x)}")
    x[...] = x + value
    return x


def histogramdd(x, bins=10, ranges=None, density=False, weights=None, name=None):
    """paddle's own count on the gathered sample (and weights): the histogram and the edges, whole."""
    whole = [(v.full() if hasattr(v, "full") else v) for v in (x, weights)]
    with _p().no_grad():
        return _p().histogramdd(whole[0].detach(), bins, ranges, density,
                                None if whole[1] is None else whole[1].detach())


def _shift(x, axes, sign):
    shape = gshape(x)
    axes = list(range(len(shape))) if axes is None else ([axes] if isinstance(axes, int) else list(axes))
    return _p().roll(x, [sign * (shape[a] // 2) for a in axes], axes)


def fftshift(x, axes=None, name=None):
    """The zero frequency to the middle: a roll by half of each axis (routed)."""
    return _shift(x, axes, 1)


def ifftshift(x, axes=None, name=None):
    return _shift(x, axes, -1)


COMPOSITES: dict = {f"paddle.{n}": globals()[n] for n in ("shape", "rank", "is_empty", "tolist", "increment",
                                                           "histogramdd")}
COMPOSITES.update({f"paddle.fft.{n}": globals()[n] for n in ("fftshift", "ifftshift")})
