"""What autoparallel knows about a user's layer, kept off the layer: its mesh and build (``parallelize``,
``shard_layer`` input sharding), the strategy and plan the automatic planner chose, the lazy-init report, and
the marks of one-time rewrites (zero-bubble split linears, the recompute setting of a lowered model). Held in
an identity-keyed weak registry (``compat.SideData``): nothing is written onto paddle objects, and an entry
goes with its layer."""
from __future__ import annotations

from autoparallel.compat import SideData

_STATE = SideData()         # layer -> {key: value}


def get(layer, key: str, default=None):
    return (_STATE.get(layer) or {}).get(key, default)


def put(layer, key: str, value) -> None:
    entry = _STATE.get(layer)
    if entry is None:
        entry = {}
        _STATE.set(layer, entry)
    entry[key] = value


def mesh_of(layer):
    """The ProcessMesh ``ap.parallelize`` (or input sharding) laid ``layer`` out on, or None."""
    return get(layer, "mesh")


def build_of(layer):
    """The ``Build`` record ``ap.parallelize`` made for ``layer`` (or its pipeline), or None."""
    return get(layer, "build")


def chosen_strategy(layer):
    """The Strategy ``ap.parallelize(..., strategy="auto")`` chose for ``layer``, or None."""
    return get(layer, "strategy")


def chosen_plan(layer):
    """The PlanResult behind ``chosen_strategy(layer)``, or None."""
    return get(layer, "plan")


def init_report(layer):
    """The lazy-initialisation report of ``layer`` (per parameter: how it was drawn), or None."""
    return get(layer, "init_report")
