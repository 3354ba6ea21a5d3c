"""Communication groups of ZeRO over the data axis of a mesh.

The data dim (size dp) is split into [dp / degree, degree]: ``degree`` consecutive data ranks form a
shard group (the optimizer states, gradients and, at stage 3, parameters are cut over it) and ranks with
the same position in different shard groups form a replica group (HSDP: gradients are also summed over
it; degree == dp leaves replica groups of one). The groups are created with a ProcessMesh, on every rank
in the same order.
"""
from __future__ import annotations

import numpy as np

from autoparallel.mesh import ProcessMesh


class ZeroGroups:
    def __init__(self, mesh: ProcessMesh, dp_dim: str = "data", degree: int | None = None):
        if not isinstance(mesh, ProcessMesh):
            raise TypeError(f"apply_zero expects an ap.ProcessMesh, got {type(mesh).__name__}")
        if dp_dim not in mesh.dim_names:
            raise ValueError(f"ZeRO shards over the data-parallel mesh dim {dp_dim!r}; the mesh has dims "
                             f"{mesh.dim_names}")
        i = mesh.dim_index(dp_dim)
        dp = mesh.shape[i]
        degree = dp if degree is None else degree
        if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1 or dp % degree:
            raise ValueError(f"sharding degree must be a positive int dividing the data-parallel degree {dp}, "
                             f"got {degree!r}")
        self.mesh, self.dp_dim, self.dp_index, self.dp, self.degree = mesh, dp_dim, i, dp, degree
        self.shard_dim, self.replica_dim = f"{dp_dim}.shard", f"{dp_dim}.replica"
        arr = np.moveaxis(np.asarray(mesh.mesh), i, -1)
        arr = arr.reshape(arr.shape[:-1] + (dp // degree, degree))
        others = [n for n in mesh.dim_names if n != dp_dim]
        self.zmesh = ProcessMesh(arr.tolist(), others + [self.replica_dim, self.shard_dim])
        self.shard_groups = self.zmesh.all_groups(self.shard_dim)
        self.replica_groups = self.zmesh.all_groups(self.replica_dim)

    def index(self, rank: int) -> int:
        """Position of ``rank`` in its shard group (which chunk it owns)."""
        return self.zmesh.coords_of(rank)[-1]

    def replica_index(self, rank: int) -> int:
        return self.zmesh.coords_of(rank)[-2]

    def __repr__(self):
        return f"ZeroGroups(dp={self.dp}, degree={self.degree}, shard groups={self.shard_groups})"


def apply_groups(xs: dict, groups, fn) -> dict:
    """Run the group collective ``fn(held, ranks)`` on every group holding some of ``xs``'s ranks."""
    out = dict(xs)
    for ranks in groups:
        held = {r: xs[r] for r in ranks if r in xs}
        if held:
            out.update(fn(held, ranks))
    return out
