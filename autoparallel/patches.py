"""The ledger of every name autoparallel replaces in paddle, so that all of them can be put back.

Every patch of a paddle module, class or function table goes through ``patch(owner, name, value)`` (or
``remember(owner, name)`` just before code that assigns the name itself). The first time a name is touched
its original is recorded exactly as it sat in the owner's ``__dict__`` (a ``staticmethod``, a property, an
inherited name that was absent); ``undo()`` restores every recorded name, newest first, and then runs the
reset callbacks the patching modules registered (``on_undo``) so their "already installed" flags read false
and a later install patches again.
"""
from __future__ import annotations

import types
import weakref

_MISSING = object()
_LEDGER: dict = {}          # (id(owner), name) -> (owner ref, name, original raw value or _MISSING)
_RESETS: list = []


def _ref(owner):
    """Modules and classes are held; other owners (a layer holding an op as an attribute) weakly, so the
    ledger keeps no model alive."""
    if isinstance(owner, (types.ModuleType, type)):
        return lambda: owner
    try:
        return weakref.ref(owner)
    except TypeError:
        return lambda: owner


def _known(key, owner) -> bool:
    entry = _LEDGER.get(key)
    return entry is not None and entry[0]() is owner


def _raw(owner, name):
    d = getattr(owner, "__dict__", None)
    if d is None:
        return getattr(owner, name, _MISSING)
    return d.get(name, _MISSING)


def remember(owner, name: str) -> None:
    """Record ``owner.name`` as it is now, unless it was recorded already (the first original wins)."""
    key = (id(owner), name)
    if not _known(key, owner):
        _LEDGER[key] = (_ref(owner), name, _raw(owner, name))


def patch(owner, name: str, value) -> None:
    """``setattr(owner, name, value)``, recording the original first. Raises what ``setattr`` raises (a
    read-only attribute), recording nothing then."""
    key = (id(owner), name)
    fresh = not _known(key, owner)
    if fresh:
        _LEDGER[key] = (_ref(owner), name, _raw(owner, name))
    try:
        setattr(owner, name, value)
    except (AttributeError, TypeError):
        if fresh:
            del _LEDGER[key]
        raise


def on_undo(fn) -> None:
    """Call ``fn()`` after every ``undo()`` (a module resets its own "installed" flags and caches)."""
    if fn not in _RESETS:
        _RESETS.append(fn)


def recorded() -> list:
    """[(owner, name, original)] of every name patched since the last undo (owners still alive), oldest
    first."""
    return [(ref(), name, raw) for ref, name, raw in _LEDGER.values() if ref() is not None]


def undo() -> int:
    """Restore every recorded name (newest first); returns how many."""
    entries = recorded()
    for owner, name, raw in reversed(entries):
        if raw is _MISSING:
            try:
                delattr(owner, name)
            except AttributeError:
                pass
        else:
            setattr(owner, name, raw)
    _LEDGER.clear()
    for fn in _RESETS:
        fn()
    return len(entries)
