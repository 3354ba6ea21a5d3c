"""The reshard cache: one bounded memo for everything the reshard path plans, and the cluster epoch.

Entries are keyed by a kind (``"plan"``, ``"graph"``, ...) and the inputs they depend on. A caller that names
its cluster puts the ClusterSpec (a frozen value) in the key. The runtime plans for an implied cluster (the
one ``ap.set_cluster`` sets, else the default of its backend); its keys hold ``cluster_epoch()`` instead,
a number that ``bump_epoch()`` renews whenever that cluster changes, so a plan priced on an old cluster is
never served. ``clear_cache()`` forgets everything.
"""
from __future__ import annotations

import itertools
from typing import Callable, Hashable

LIMIT = 16384                   # entries; the whole cache is dropped when full (plans are cheap to redo)

_CACHE: dict = {}
_EPOCHS = itertools.count(1)
_epoch = [0]


def get(key: Hashable):
    """The entry under ``key``, or None."""
    return _CACHE.get(key)


def put(key: Hashable, value):
    """Store ``value`` under ``key`` and return it."""
    if len(_CACHE) >= LIMIT:
        _CACHE.clear()
    _CACHE[key] = value
    return value


def memo(key: Hashable, compute: Callable[[], object]):
    """The entry under ``key``, computed by ``compute()`` on a miss."""
    value = _CACHE.get(key)
    return put(key, compute()) if value is None else value


def clear_cache() -> None:
    """Forget every cached plan, priced graph and runtime reshard target."""
    _CACHE.clear()


def size() -> int:
    return len(_CACHE)


def cluster_epoch() -> int:
    """The number of the cluster runtime reshards are planned for (0 until the cluster is first changed)."""
    return _epoch[0]


def bump_epoch() -> int:
    """A new epoch: the implied planning cluster changed (``ap.set_cluster``). Returns it."""
    _epoch[0] = next(_EPOCHS)
    return _epoch[0]
