"""State leaves whose data is not a paddle tensor, DistTensor or array of their own.

``ShardedLeaf``: one global (logical) tensor whose pieces live in some runtime's buffers, e.g. a ZeRO
optimizer's flat per-rank chunks. It tells the save which boxes this process writes and the load which
boxes it needs, and puts loaded boxes back itself; the checkpoint stores it like any distributed tensor,
so it loads into a plain or DistTensor of the same name and vice versa.

``HeldElsewhere``: an entry of the job's state that another rank holds (a pipeline stage this rank does
not run). Every rank's state then has the same names: the save skips it, the load checks that the
checkpoint has it and reads nothing.
"""
from __future__ import annotations


class ShardedLeaf:
    """Subclasses set ``shape`` (global, tuple) and ``dtype`` (str) and implement the three methods."""

    shape: tuple = ()
    dtype: str = "float32"

    def saved_boxes(self) -> list:
        """[(writer rank, global offsets, numpy array)]: the boxes this process writes, each once per job."""
        raise NotImplementedError

    def wanted_boxes(self) -> list:
        """[(key, global offsets, shape)]: the boxes this process needs when loading."""
        raise NotImplementedError

    def assign(self, loaded: list) -> None:
        """Put the loaded [(key, numpy array)] (every wanted box) back into the runtime's buffers."""
        raise NotImplementedError

    def held_boxes(self) -> list:
        """[(global offsets, numpy array)] of everything this process holds (for checks and tests)."""
        raise NotImplementedError

    def layout_json(self) -> dict:
        """What the metadata records as this tensor's layout (informational)."""
        return {"mesh": None, "placements": None}


class HeldElsewhere:
    """A state entry of another rank (see the module docstring)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "HeldElsewhere()"


ELSEWHERE = HeldElsewhere()
