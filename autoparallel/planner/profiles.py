"""Built-in cluster profiles for ``auto_mode="full"`` when no calibrated profile is given, and resizing a
profile to the world that runs.

``CPU_PROFILE`` is what ``autoparallel calibrate`` measured on a reference machine (x86_64, 2 cores
shared by 4 gloo ranks, paddle 3.3.1): collective fits for groups of 2 and 4, per-op costs, matmul rate
and copy bandwidth per rank. Another machine should run ``autoparallel calibrate`` and point
``AP_CLUSTER_PROFILE`` at the result; the built-in one keeps decisions sensible (and deterministic).
"""
from __future__ import annotations

from dataclasses import replace

from autoparallel.core.cluster import ClusterSpec, CollectiveFit, LinkSpec, RuntimeSpec, preset

# (collective, group size) -> (latency s, bandwidth B/s), measured after a burst of eager ops
_FITS = {
    ("all_gather", 2): (3.54e-3, 2.8e8), ("all_gather", 4): (8.26e-3, 1.1e8),
    ("all_reduce", 2): (4.08e-3, 7.1e8), ("all_reduce", 4): (1.05e-2, 4.3e8),
    ("all_to_all", 2): (3.90e-3, 1.8e9), ("all_to_all", 4): (8.24e-3, 5.9e8),
    ("broadcast", 2): (2.81e-3, 9.3e8), ("broadcast", 4): (3.80e-3, 7.9e8),
    ("reduce_scatter", 2): (4.59e-3, 6.4e8), ("reduce_scatter", 4): (9.64e-3, 3.8e8),
    ("send_recv", 2): (1.72e-3, 1.3e9),
}
_RUNTIME = RuntimeSpec(op_s=3.3e-6, dispatch_s=7.4e-5, backward_s=3.9e-5, optimizer_tensor_s=4.5e-5,
                       recompute_s=5.0e-4)
_FLOPS, _BANDWIDTH, _MEMORY = 1.6e10, 1.2e10, 2.5e10     # per rank: FLOP/s, copy B/s; machine memory bytes


def cpu_default(ranks: int = 4) -> ClusterSpec:
    """The built-in CPU/gloo profile (see the module docstring) for ``ranks`` ranks."""
    from autoparallel.planner.calibrate import cpu_profile

    fits = tuple(CollectiveFit(name, n, a, b) for (name, n), (a, b) in _FITS.items())
    a, b = _FITS[("send_recv", 2)]
    return cpu_profile(_FLOPS, _BANDWIDTH * ranks, _MEMORY, ranks, name="cpu-default", link=LinkSpec(a, b),
                       extra=(("ranks_busy", 4), ("source", "built-in: measured on the development machine")),
                       collectives=fits, runtime=_RUNTIME)


def default_profile(backend: str) -> ClusterSpec:
    """gloo: the built-in CPU profile; nccl (or anything else): nodes of 8 A100-80GB."""
    return cpu_default() if backend in ("gloo", "sim") else preset("A100-80GB", 1, 8)


def for_world(cluster: ClusterSpec, world: int) -> ClusterSpec:
    """``cluster`` resized to ``world`` ranks: whole nodes when ``world`` is a multiple of a node, else one
    node of ``world`` devices (a CPU profile always stays one node: the ranks share one machine)."""
    if isinstance(world, bool) or not isinstance(world, int) or world <= 0:
        raise ValueError(f"world size must be a positive integer, got {world!r}")
    if world == cluster.world_size:
        return cluster
    if cluster.runtime is None and world % cluster.devices_per_node == 0:
        return cluster.with_nodes(world // cluster.devices_per_node)
    name = cluster.name.split(":", 1)[-1]
    return replace(cluster, name=f"1x{world}:{name}", num_nodes=1, devices_per_node=world)
