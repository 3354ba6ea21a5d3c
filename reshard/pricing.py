"""Prices one reshard step with the shared cost formulas (autoparallel.core.cost) on a cluster's links.

``b`` is the padded local size entering the step (``DistSpec.local_nbytes``), so an uneven shard costs like
the padded collective the runtime runs; ``n`` is the mesh-dim size; the link is the slowest one any group
of that mesh dim communicates over.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from autoparallel.core.capabilities import capabilities
from autoparallel.core.collective import Collective
from autoparallel.core.cost import collective_seconds, emulated_bytes
from autoparallel.core.mesh import ProcessMesh
from autoparallel.core.placement import Partial
from autoparallel.core.cluster import ClusterSpec
from autoparallel.core.spec import DistSpec

FREE = (Collective.SLICE, Collective.LOCAL)


@dataclass(frozen=True)
class Price:
    bytes_per_rank: float
    seconds: float
    emulated: Optional[str] = None


ZERO = Price(0.0, 0.0, None)


class Pricer:
    """Prices steps of one (shape, dtype, mesh, cluster); memoizes local sizes per state."""

    def __init__(self, shape: tuple, dtype: str, mesh: ProcessMesh, cluster: ClusterSpec):
        self.shape, self.dtype, self.mesh, self.cluster = shape, dtype, mesh, cluster
        self.caps = capabilities(cluster.backend)
        self.links = [mesh_dim_links(mesh, cluster, i) for i in range(mesh.ndim)]
        self._nbytes = {}

    def local_nbytes(self, state: tuple) -> int:
        b = self._nbytes.get(state)
        if b is None:
            b = self._nbytes[state] = DistSpec(self.mesh, state, self.shape, self.dtype).local_nbytes()
        return b

    def price(self, collective: str, i: int, state: tuple) -> Price:
        """Cost of running ``collective`` on mesh dim ``i`` from ``state``."""
        n = self.mesh.shape[i]
        if collective in FREE or n == 1:
            return ZERO
        b = self.local_nbytes(state)
        backend = self.cluster.backend
        nbytes = emulated_bytes(collective, b, n, backend)
        seconds = slowest_seconds(collective, b, n, self.links[i], backend)
        return Price(float(nbytes), float(seconds), self.emulation(collective, state[i]))

    def emulation(self, collective: str, placement) -> Optional[str]:
        """How the backend runs ``collective`` when it lacks it (or the reduce op / dtype), else None."""
        parts = list(self.caps.emulation(collective) or (collective,))
        changed = parts != [collective]
        if isinstance(placement, Partial):
            if not self.caps.reduce_natively(placement.reduce_type):
                parts[0] += "(sum)"
                parts.insert(1, "scale")
                changed = True
            if self.caps.reduce_dtype(self.dtype) != self.dtype:
                parts[0] += f" in {self.caps.reduce_dtype(self.dtype)}"
                changed = True
        if not changed:
            return None
        if parts == ["send_recv"]:
            return "pairwise send_recv"
        return " + ".join(parts)


def mesh_dim_links(mesh: ProcessMesh, cluster: ClusterSpec, i: int) -> tuple:
    """The distinct links the groups of mesh dim ``i`` communicate over."""
    return tuple(dict.fromkeys(cluster.link_for(g) for g in mesh.all_groups(i)))


def slowest_seconds(collective: str, b: float, n: int, links, backend: str) -> float:
    return max(collective_seconds(collective, b, n, link.latency_s, link.bandwidth_Bps, backend) for link in links)
