"""Collective: what one step of a reshard plan runs, named once.

The reshard planner picks a step's collective from this enum (``reshard/transitions.py``); the runtime
executes it by looking the member up in its executor table (``autoparallel/reshard_exec.py``). Members are
strings (``Collective.ALL_GATHER == "all_gather"``), so plans print, compare and serialize as their names.
"""
from __future__ import annotations

from enum import StrEnum


class Collective(StrEnum):
    SLICE = "slice"                     # R -> S(d): keep this rank's chunk, no communication
    ALL_GATHER = "all_gather"           # S(d) -> R
    ALL_REDUCE = "all_reduce"           # P -> R
    REDUCE_SCATTER = "reduce_scatter"   # P -> S(d)
    ALL_TO_ALL = "all_to_all"           # S(a) -> S(b)
    LOCAL = "local"                     # R -> P(op): the value becomes pending terms, no communication
    SEND_RECV = "send_recv"             # every local tensor to the same position of another mesh

    def __repr__(self) -> str:         # reads like the name it equals: ['all_reduce', 'all_gather']
        return repr(self.value)

    @property
    def communicates(self) -> bool:
        return self not in (Collective.SLICE, Collective.LOCAL)

    @classmethod
    def of(cls, name) -> "Collective":
        """``"all_gather"`` or ``Collective.ALL_GATHER`` -> ``Collective.ALL_GATHER``; anything else is a
        ValueError naming the known collectives."""
        if isinstance(name, cls):
            return name
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"a reshard step runs one of {[c.value for c in cls]}, got {name!r}") from None
