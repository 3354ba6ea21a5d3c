"""Creation order of parameters built under ``paddle.LazyGuard``.

An eager build draws every parameter's initial values from the global generator at the moment the
parameter is created, so lazy materialisation must follow creation order to see the same stream.
Paddle records no order, so ``install()`` wraps ``Initializer._lazy_init`` (the call paddle makes for
each parameter created under the guard) to stamp a sequence number on the parameter. Parameters
without a stamp (built before the wrapper was installed) fall back to registration order, which equals
creation order for layers that create their parameters and sublayers in the order they register them
(paddle's own layers and the example models).

The stamp also records the global generator's state (``stream_key``). Lazy materialisation reproduces an
eager build only when nothing drew from the generator after the first lazy parameter was created: in an
eager build that draw would have come after the parameters' draws. ``stream_check`` says when it did (a
model whose ``__init__`` draws random numbers itself, or a draw between the build and ``materialize``).
"""
from __future__ import annotations

import itertools
import re

import paddle

from autoparallel import patches
from autoparallel.compat import SideData, lazy_init_method

_counter = itertools.count()
_SEQ = SideData()           # parameter -> its creation stamp
_KEY = SideData()           # parameter -> the generator's state when it was created
_AFTER: dict = {}           # generator state before a materialisation -> the state after it
_POINTER = re.compile(r"0x[0-9a-f]+")


def stream_key() -> int:
    """The global generator's state (every device's), as a comparable key."""
    return hash(tuple(_POINTER.sub("", str(g)) for g in paddle.get_rng_state()))


def install() -> None:
    """Stamp the creation order of parameters created lazily from now on (idempotent)."""
    owner, name = lazy_init_method()
    original = getattr(owner, name)
    if getattr(original, "_ap_stamps", False):
        return

    def _lazy_init(self, param, block=None):
        out = original(self, param, block)
        _SEQ.set(param, next(_counter))
        _KEY.set(param, stream_key())
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


def stream_check(origins) -> str | None:
    """Why materialising ``origins`` (lazily created parameters) now would NOT give an eager build's values,
    or None. Each must have been created at one generator state (nothing drew between their creations), and the
    generator must still be there -- or where the materialisations of earlier-built models moved it."""
    keys = {_KEY.get(p) for p in origins} - {None}
    if not keys:
        return None
    if len(keys) > 1:
        return ("random numbers were drawn from the global generator between the creations of the model's "
                "parameters (e.g. its __init__ calls a random op itself)")
    key, now = keys.pop(), stream_key()
    for _ in range(len(_AFTER) + 1):
        if key == now:
            return None
        if key not in _AFTER:
            break
        key = _AFTER[key]
    return "random numbers were drawn from the global generator after the model was built lazily"


def stream_advanced(before: int) -> None:
    """Record that a materialisation moved the generator from ``before`` to its current state."""
    after = stream_key()
    if after != before:
        _AFTER[before] = after
