"""The ledger of every name autoparallel replaces in paddle, so that all of them can be put back.

Every patch of a paddle module, class or function table goes through ``patch(owner, name, value)`` (or
``remember(owner, name)`` just before code that assigns the name itself). The first time a name is touched
its original is recorded exactly as it sat in the owner's ``__dict__`` (a ``staticmethod``, a property, an
inherited name that was absent); ``undo()`` restores every recorded name, newest first, and then runs the
reset callbacks the patching modules registered (``on_undo``) so their "already installed" flags read false
and a later install patches again. A patch its own code removes again goes back with ``put_back`` (the ledger
forgets it), and a patch for the length of a block is ``with swapped(owner, {name: value}):``.
"""
from __future__ import annotations

import contextlib
import types
import weakref

_MISSING = object()
_LEDGER: dict = {}          # (id(owner), name) -> (owner ref, name, original raw value or _MISSING)
_RESETS: list = []
_UNDOS = [0]                # how many undo() calls so far (a temporary swap sees one that ran inside it)


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


def _set_raw(owner, name, raw) -> None:
    if raw is _MISSING:
        try:
            delattr(owner, name)
        except AttributeError:
            pass
    else:
        setattr(owner, name, raw)


def original(owner, name: str):
    """The recorded original of ``owner.name`` as it sat in the owner's ``__dict__`` (``MISSING`` when it
    was absent), or its current raw value when the ledger has no entry."""
    key = (id(owner), name)
    return _LEDGER[key][2] if _known(key, owner) else _raw(owner, name)


def put_back(owner, name: str, raw) -> None:
    """Set ``owner.name`` back to ``raw`` (``MISSING``: remove it), a patch undone by the code that made it;
    the ledger forgets the name when ``raw`` is its recorded original."""
    _set_raw(owner, name, raw)
    key = (id(owner), name)
    if _known(key, owner) and _LEDGER[key][2] is raw:
        del _LEDGER[key]


@contextlib.contextmanager
def swapped(owner, values: dict):
    """Set ``owner``'s names to ``values`` for a block (recorded in the ledger meanwhile, so an ``undo()``
    from another thread or a crash report finds them), then put back what the block found. When ``undo()``
    ran inside the block, the originals are put back instead (the block must not re-install a patch that
    undo removed)."""
    found = {n: _raw(owner, n) for n in values}
    first = {n: original(owner, n) for n in values}
    undos = _UNDOS[0]
    try:
        for n, v in values.items():
            patch(owner, n, v)
        yield
    finally:
        for n in reversed(list(values)):
            if _UNDOS[0] == undos:
                put_back(owner, n, found[n])
            else:
                _set_raw(owner, n, first[n])


MISSING = _MISSING
PASS_THROUGH: set = set()   # code objects of wrappers that only hand a caller's call on (timing, argument checks)


def pass_through(fn):
    """Mark ``fn`` (a wrapper over a patched function) as handing its caller's call on unchanged: code that asks
    who made a call (``collective_guard``) looks past its frame to the caller."""
    PASS_THROUGH.add(fn.__code__)
    return fn


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
        _set_raw(owner, name, raw)
    _LEDGER.clear()
    _UNDOS[0] += 1
    for fn in _RESETS:
        fn()
    return len(entries)
