"""Composite ops (see composites.py): ``linalg.cov`` / ``linalg.corrcoef`` (means, ``mm``, ``diag``: paddle 3.3's
own body in ``paddle/tensor/linalg.py``, every op routed), ``combinations`` and ``pdist`` (the index tuples are
known from the global length; the elements are gathered by them), and ``multigammaln(_)`` / ``frexp``, paddle's own
python bodies run with their ops routed."""
from __future__ import annotations

import itertools
import numbers

from spmd_rules.composites import _p, gshape


def _observations(x, rowvar):
    """x as variables x observations (paddle's ``nx``)."""
    s = gshape(x)
    if not 1 <= len(s) <= 2:
        raise ValueError(f"cov: x must have 1 or 2 dims, got shape {list(s)}")
    nx = x.reshape([1, -1]) if len(s) == 1 else x
    if not rowvar and gshape(nx)[0] != 1:
        nx = nx.t()
    return nx


def _weight(name, w, n, dtype):
    """A 1-D weight of ``n`` observations, checked as paddle checks it (its values read: the global ones)."""
    if len(gshape(w)) != 1 or gshape(w)[0] != n:
        raise ValueError(f"cov: {name} must be 1-D with x's {n} observations, got shape {list(gshape(w))}")
    if float(w.min()) < 0:
        raise ValueError(f"cov: {name} cannot be negative, got a minimum of {float(w.min())}")
    return w.astype(dtype)


def cov(x, rowvar=True, ddof=True, fweights=None, aweights=None, name=None):
    paddle = _p()
    nx = _observations(x, rowvar)
    n = gshape(nx)[1]
    w = None
    if fweights is not None:
        w = _weight("fweights", fweights, n, nx.dtype)
        if not bool(paddle.all(fweights == paddle.round(fweights.astype("float64")).astype(fweights.dtype))):
            raise ValueError("cov: fweights must be integers")
    if aweights is not None:
        aw = _weight("aweights", aweights, n, nx.dtype)
        w = aw if w is None else w * aw
    if w is None:
        w_sum, nx_w = float(n), nx
        avg = nx.sum(axis=1) / w_sum
    else:
        w_sum = w.sum()
        if float(w_sum) == 0:
            raise ValueError("cov: the sum of weights is zero, can't be normalized")
        nx_w = nx * w
        avg = nx_w.sum(axis=1) / w_sum
    if w is not None and aweights is not None and ddof:
        norm = w_sum - (w * aweights.astype(w.dtype)).sum() / w_sum
    else:
        norm = w_sum - ddof
    norm = paddle.clip(norm, min=0) if not isinstance(norm, float) else max(norm, 0.0)
    centred = nx - avg.unsqueeze(1)
    return (paddle.mm(centred, nx_w.t()) / norm).squeeze()


def corrcoef(x, rowvar=True, name=None):
    paddle = _p()
    c = cov(x, rowvar)
    if len(gshape(c)) == 0:
        return c / c
    std = paddle.sqrt(paddle.diag(c))
    return paddle.clip(c / std.unsqueeze(1) / std.unsqueeze(0), -1, 1)


def combinations(x, r=2, with_replacement=False, name=None):
    paddle = _p()
    s = gshape(x)
    if len(s) != 1:
        raise TypeError(f"combinations: expects a 1-D vector, got shape {list(s)}")
    if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 0:
        raise ValueError(f"combinations: r must be a non-negative int, got {r!r}")
    if r == 0:
        return x[:0]
    pick = itertools.combinations_with_replacement if with_replacement else itertools.combinations
    rows = list(pick(range(s[0]), r))
    if not rows:
        return paddle.stack([x[:0]] * r, axis=1)
    idx = paddle.to_tensor(rows, dtype="int64")
    return paddle.stack([paddle.gather(x, idx[:, k]) for k in range(r)], axis=1)


def pdist(x, p=2.0, name=None):
    """The p-norm distance of every pair of rows i < j of an N x M matrix, in row-major pair order (paddle's): the
    pairs are known from N; the rows are gathered by them and their difference reduced over the features."""
    paddle = _p()
    s = gshape(x)
    if len(s) != 2:
        raise ValueError(f"pdist: x must be 2-D (N x M), got shape {list(s)}")
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or p < 0:
        raise ValueError(f"pdist: p must be a non-negative number, got {p!r}")
    pairs = list(itertools.combinations(range(s[0]), 2))
    if not pairs:
        return x[:0, 0]
    idx = paddle.to_tensor(pairs, dtype="int64")
    diff = (paddle.gather(x, idx[:, 0]) - paddle.gather(x, idx[:, 1])).abs()
    if p == 0:
        return (diff > 0).astype(diff.dtype).sum(axis=1)
    if p == float("inf"):
        return diff.max(axis=1)
    return diff.pow(p).sum(axis=1).pow(1.0 / p)


def _paddle_body(name):
    """paddle's own python function ``paddle.<name>`` (under dispatch's wrapper): run on distributed tensors, each
    op in its body is routed (it is written over ops that have rules)."""
    f = getattr(_p(), name)
    while getattr(f, "_ap_wrapper", False):
        f = f.__wrapped__
    return f


def multigammaln(x, p, name=None):
    return _paddle_body("multigammaln")(x, p)


def multigammaln_(x, p, name=None):
    return _paddle_body("multigammaln_")(x, p)


def frexp(x, name=None):
    return _paddle_body("frexp")(x)


COMPOSITES: dict = {"paddle.linalg.cov": cov, "paddle.linalg.corrcoef": corrcoef, "paddle.combinations": combinations,
                    "paddle.pdist": pdist, "paddle.multigammaln": multigammaln, "paddle.multigammaln_": multigammaln_,
                    "paddle.frexp": frexp}
