"""Topology: the fabric behind a cluster's two links, as the collective model sees it.

A node holds ``gpus_per_node`` GPUs on NVLink (or Infinity Fabric) and ``nics_per_node`` NICs of
``nic_bandwidth_Bps`` each (unidirectional). One GPU's share of the network is nics·nic_bw/gpus_per_node.
Nodes hang off leaf switches of ``nodes_per_leaf`` nodes (0: a non-blocking fabric); traffic leaving a leaf
shares its uplinks, ``oversubscription`` times fewer than its downlinks. On a rail-optimised fabric the
leaf ("rail") switch joins the same-index NIC of every node of the leaf group, so traffic between GPUs of the
same local index stays on one rail; traffic between different local indices (all-to-all) first crosses
NVLink to the GPU on the right rail (NCCL's PXN), which the model charges as extra NVLink traffic.

The cluster's ``inter_node`` link carries the GPU's nominal network share (presets set it to
``nic_share_Bps``), so scaling the link (e.g. to a measured rate) scales the network too; the topology adds
the efficiency, the oversubscription, host RAM and PCIe. Achieved bandwidth is a fraction of line rate: NCCL's bus bandwidth on 8xA100 NVLink is 230-250 GB/s of
300 (``nvlink_efficiency`` 0.8) and multi-node InfiniBand reaches about 90% of line rate
(``network_efficiency`` 0.9); docs/planner.md lists the sources.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Topology:
    nics_per_node: int = 8                # network adapters per node
    nic_bandwidth_Bps: float = 25e9       # line rate of one NIC, one direction (HDR 200 Gb/s = 25 GB/s)
    rail_optimized: bool = True           # NIC i of every node on rail switch i
    nodes_per_leaf: int = 0               # nodes under one leaf / rail group (0: non-blocking fabric)
    oversubscription: float = 1.0         # leaf downlink : uplink bandwidth ratio (1: full bisection)
    host_memory_bytes: float = 1e12       # host RAM per node
    pcie_bandwidth_Bps: float = 12e9      # device<->host bytes/s per GPU (PCIe shared by two GPUs)
    nvlink_efficiency: float = 0.8        # achieved / nominal intra-node bandwidth (NCCL bus bandwidth)
    network_efficiency: float = 0.9       # achieved / nominal NIC bandwidth (NCCL bus bandwidth)
    gpus_per_node: int = 0                # 0: the cluster's devices_per_node; else must equal it

    def __post_init__(self):
        for name in ("nics_per_node", "nodes_per_leaf", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "nics_per_node" else 0):
                raise ValueError(f"topology {name} must be a {'positive' if name == 'nics_per_node' else 'non-negative'}"
                                 f" integer, got {value!r}")
        for name in ("nic_bandwidth_Bps", "host_memory_bytes", "pcie_bandwidth_Bps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"topology {name} must be > 0, got {getattr(self, name)!r}")
        if not self.oversubscription >= 1:
            raise ValueError(f"topology oversubscription is downlink:uplink and must be >= 1, got {self.oversubscription}")
        for name in ("nvlink_efficiency", "network_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"topology {name} must be in (0, 1], got {getattr(self, name)}")

    def check(self, num_nodes: int, devices_per_node: int) -> None:
        """A topology that does not match the cluster's device layout is a ValueError."""
        if self.gpus_per_node and self.gpus_per_node != devices_per_node:
            raise ValueError(f"the topology has {self.gpus_per_node} GPUs per node but the cluster has "
                             f"{devices_per_node} devices per node ({num_nodes} nodes, "
                             f"{num_nodes * devices_per_node} devices)")

    def nic_share_Bps(self, gpus_per_node: int) -> float:
        """One GPU's share of its node's network line rate."""
        return self.nics_per_node * self.nic_bandwidth_Bps / gpus_per_node

    def network_Bps(self, gpus_per_node: int, nodes: int, share_Bps: float = None) -> float:
        """Achieved per-GPU network bandwidth for traffic among ``nodes`` nodes (oversubscribed beyond a leaf).
        ``share_Bps``: the GPU's nominal share (the cluster's inter-node link, which presets derive from
        ``nic_share_Bps``); default: this topology's NICs."""
        bw = (self.nic_share_Bps(gpus_per_node) if share_Bps is None else share_Bps) * self.network_efficiency
        if self.nodes_per_leaf and nodes > self.nodes_per_leaf:
            bw /= self.oversubscription
        return bw

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Topology":
        return cls(**d)


def topology_of(cluster) -> Topology:
    """The cluster's topology, or one derived from its links: a NIC per GPU at the inter-node link's speed,
    host RAM of 1 TB per node, and both efficiencies 1 (a hand-written or calibrated link is taken as measured)."""
    if cluster.topology is not None:
        return cluster.topology
    return Topology(nics_per_node=cluster.devices_per_node, nic_bandwidth_Bps=cluster.inter_node.bandwidth_Bps,
                    nvlink_efficiency=1.0, network_efficiency=1.0)
