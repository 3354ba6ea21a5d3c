"""The reshard cache: one bounded memo for everything the reshard path plans, and the cluster epoch.

Entries are keyed by a kind (``"plan"``, ``"graph"``, ...) followed by the inputs they depend on, and bounded
per kind. A caller that names its cluster puts the ClusterSpec (a frozen value) in the key. The runtime plans for an implied cluster (the
one ``ap.set_cluster`` sets, else the default of its backend); its keys hold ``cluster_epoch()`` instead,
a number that ``bump_epoch()`` renews whenever that cluster changes, so a plan priced on an old cluster is
never served. ``clear_cache()`` forgets everything.
"""
from __future__ import annotations

import itertools
from typing import Callable

# Entries per kind (the first item of every key); a kind that fills up is dropped whole (plans are cheap to
# redo). Priced state graphs are the big entries (tens to hundreds of KB on 2-d and 3-d meshes).
LIMITS = {"graph": 256, "pricer": 256, "cross": 1024}
DEFAULT_LIMIT = 4096

_SECTIONS: dict = {}            # kind -> {key: value}
_EMPTY: dict = {}
_EPOCHS = itertools.count(1)
_epoch = [0]


def get(key: tuple):
    """The entry under ``key`` (a tuple starting with its kind), or None; an unhashable key is a TypeError."""
    return _SECTIONS.get(key[0], _EMPTY).get(key)


def put(key: tuple, value):
    """Store ``value`` under ``key`` and return it."""
    section = _SECTIONS.setdefault(key[0], {})
    if len(section) >= LIMITS.get(key[0], DEFAULT_LIMIT):
        section.clear()
    section[key] = value
    return value


def memo(key: tuple, compute: Callable[[], object]):
    """The entry under ``key``, computed by ``compute()`` on a miss."""
    value = get(key)
    return put(key, compute()) if value is None else value


def clear_cache() -> None:
    """Forget every cached plan, priced graph and runtime reshard target."""
    _SECTIONS.clear()


def size() -> int:
    return sum(len(section) for section in _SECTIONS.values())


def cluster_epoch() -> int:
    """The number of the cluster runtime reshards are planned for (0 until the cluster is first changed)."""
    return _epoch[0]


def bump_epoch() -> int:
    """A new epoch: the implied planning cluster changed (``ap.set_cluster``). Returns it."""
    _epoch[0] = next(_EPOCHS)
    return _epoch[0]
