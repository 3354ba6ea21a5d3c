"""Creation order of parameters built under ``paddle.LazyGuard``.

An eager build draws every parameter's initial values from the global generator at the moment the
parameter is created, so lazy materialisation must follow creation order to see the same stream.
Paddle records no order, so ``install()`` wraps ``Initializer._lazy_init`` (the call paddle makes for
each parameter created under the guard) to stamp a sequence number on the parameter. Parameters
without a stamp (built before the wrapper was installed) fall back to registration order, which equals
creation order for layers that create their parameters and sublayers in the order they register them
(paddle's own layers and the example models).
"""
from __future__ import annotations

import itertools

from autoparallel import patches
from autoparallel.compat import SideData, lazy_init_method

_counter = itertools.count()
_SEQ = SideData()           # parameter -> its creation stamp


def install() -> None:
    """Stamp the creation order of parameters created lazily from now on (idempotent)."""
    owner, name = lazy_init_method()
    original = getattr(owner, name)
    if getattr(original, "_ap_stamps", False):
        return

    def _lazy_init(self, param, block=None):
        out = original(self, param, block)
        _SEQ.set(param, next(_counter))
        return out

    _lazy_init._ap_stamps = True
    patches.patch(owner, name, _lazy_init)


def sequence(param):
    """The creation stamp of a lazily created parameter, or None."""
    return _SEQ.get(param)


def creation_order(items):
    """``items``: [(origin parameter, value)] in registration order -> the same, in creation order when
    every origin carries a stamp (otherwise unchanged)."""
    stamps = [sequence(origin) for origin, _ in items]
    if items and all(s is not None for s in stamps):
        return [item for _, item in sorted(zip(stamps, items), key=lambda t: t[0])]
    return list(items)
