"""ClusterSpec: devices, nodes and links, as the cost model sees them.

A cluster is ``num_nodes`` nodes of ``devices_per_node`` devices; ranks are numbered node-major
(rank r lives on node r // devices_per_node). A communication group whose ranks share one node uses
the intra-node link (NVLink), otherwise the inter-node link (InfiniBand). Spec strings:
``"128x8:A100-80GB"`` = 128 nodes of 8 A100-80GB.

``topology`` describes the fabric behind those two links (core/topology.py): GPUs and NICs per node,
NIC speed, rail-optimised or not, leaf size and oversubscription, host RAM and PCIe per node, and the
achieved fraction of line rate (NCCL bus bandwidth); presets carry the published figures of their systems.

A calibrated profile (``autoparallel calibrate``) also carries measured alpha-beta fits per collective
and group size (``collectives``), which override the link model for those group sizes, and the costs of
the eager runtime on this machine (``runtime``: per-op dispatch, backward and optimizer overheads).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, replace

from autoparallel.core.topology import Topology


@dataclass(frozen=True)
class LinkSpec:
    latency_s: float          # alpha: seconds per message step
    bandwidth_Bps: float      # 1/beta: bytes per second one rank can send on this link


@dataclass(frozen=True)
class CollectiveFit:
    """Measured time of one collective over groups of ``group_size`` ranks: latency_s + b / bandwidth_Bps,
    with b the bytes one rank holds entering it (core/cost.py's convention), emulations included."""
    collective: str
    group_size: int
    latency_s: float          # alpha: seconds of a zero-byte call
    bandwidth_Bps: float      # 1/beta: bytes per second of the fitted slope

    def seconds(self, nbytes):
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class RuntimeSpec:
    """Per-op costs of the eager runtime on one rank, measured with every rank busy (CPU profiles)."""
    op_s: float               # one plain eager paddle op on a small tensor
    dispatch_s: float         # one forward op on distributed tensors (rule, layout, local op)
    backward_s: float         # the backward of one dispatched forward op
    optimizer_tensor_s: float  # one parameter tensor of an AdamW step
    recompute_s: float = None  # one forward op run again by recompute (saved-tensor hooks included); None: dispatch_s

    @property
    def recompute_op_s(self) -> float:
        return self.dispatch_s if self.recompute_s is None else self.recompute_s


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: tuple         # ((dtype, dense FLOP/s), ...) e.g. (("bfloat16", 312e12), ("float32", 19.5e12))
    memory_bytes: float       # device memory capacity
    memory_bandwidth_Bps: float

    def flops(self, dtype: str = "bfloat16") -> float:
        table = dict(self.peak_flops)
        if dtype in table:
            return table[dtype]
        if dtype == "float16" and "bfloat16" in table:
            return table["bfloat16"]
        raise ValueError(f"device {self.name} has no peak FLOP/s for {dtype!r}; known: {sorted(table)}")


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    num_nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    backend: str = "nccl"     # capability table used to price collectives ("nccl", "gloo")
    overlap: float = 1.0      # fraction of overlappable communication hidden behind compute (0 on gloo)
    extra: tuple = field(default_factory=tuple)   # free-form (key, value) pairs, e.g. calibration facts
    collectives: tuple = field(default_factory=tuple)   # measured CollectiveFits (calibrated profiles)
    runtime: RuntimeSpec = None   # eager-runtime costs (calibrated profiles); None: a GPU cluster model
    topology: Topology = None     # the fabric (None: derived from the two links, see topology_of)

    def __post_init__(self):
        if self.num_nodes <= 0 or self.devices_per_node <= 0:
            raise ValueError(f"a cluster needs at least one node and one device per node, got "
                             f"{self.num_nodes} nodes x {self.devices_per_node} devices")
        if self.topology is not None:
            self.topology.check(self.num_nodes, self.devices_per_node)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def link_for(self, ranks) -> LinkSpec:
        """The link a group of ranks communicates over: intra-node if they share a node."""
        nodes = {self.node_of(r) for r in ranks}
        return self.intra_node if len(nodes) <= 1 else self.inter_node

    def collective_fit(self, collective: str, group_size: int):
        """The measured fit of ``collective`` over ``group_size`` ranks, or None."""
        for fit in self.collectives:
            if fit.collective == collective and fit.group_size == group_size:
                return fit
        return None

    def with_nodes(self, num_nodes: int) -> "ClusterSpec":
        return replace(self, num_nodes=num_nodes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ClusterSpec":
        """Inverse of ``to_dict``; a profile missing a field or with a malformed one is a ValueError."""
        if not isinstance(d, dict):
            raise ValueError(f"a cluster profile is a JSON object, got {type(d).__name__}")
        try:
            return cls._from_dict(d)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed cluster profile {d.get('name', '?')!r}: {type(exc).__name__} {exc}; "
                             f"expected the fields of ClusterSpec.to_dict() (write one with 'autoparallel "
                             f"calibrate')") from None

    @classmethod
    def _from_dict(cls, d: dict) -> "ClusterSpec":
        dev = d["device"]
        return cls(name=d["name"], num_nodes=int(d["num_nodes"]), devices_per_node=int(d["devices_per_node"]),
                   device=DeviceSpec(dev["name"], tuple(tuple(x) for x in dev["peak_flops"]),
                                     float(dev["memory_bytes"]), float(dev["memory_bandwidth_Bps"])),
                   intra_node=LinkSpec(**d["intra_node"]), inter_node=LinkSpec(**d["inter_node"]),
                   backend=d.get("backend", "nccl"), overlap=float(d.get("overlap", 1.0)),
                   extra=tuple(tuple(x) for x in d.get("extra", ())),
                   collectives=tuple(CollectiveFit(str(c["collective"]), int(c["group_size"]), float(c["latency_s"]),
                                                   float(c["bandwidth_Bps"])) for c in d.get("collectives", ())),
                   runtime=RuntimeSpec(**{k: None if v is None else float(v) for k, v in d["runtime"].items()})
                   if d.get("runtime") else None,
                   topology=Topology.from_dict(d["topology"]) if d.get("topology") else None)

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def from_json(cls, path: str) -> "ClusterSpec":
        if not os.path.isfile(path):
            kind = IsADirectoryError if os.path.isdir(path) else FileNotFoundError
            raise kind(f"cluster profile {path!r} is not a file: expected a profile .json (written by 'autoparallel "
                       f"calibrate') or a spec like '128x8:A100-80GB'")
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"cluster profile {path!r} is not valid JSON: {e}") from None
        return cls.from_dict(d)


GB = 1e9
TB = 1e12

# Dense peak FLOP/s per dtype, HBM capacity and bandwidth (vendor datasheets; see docs/planner.md "Hardware").
# fp8 is priced where the hardware has it; the runtime cannot run it (planner-only).
DEVICES = {
    "A100-40GB": DeviceSpec("A100-40GB", (("bfloat16", 312e12), ("float16", 312e12), ("float32", 19.5e12)), 40e9, 1.555e12),
    "A100-80GB": DeviceSpec("A100-80GB", (("bfloat16", 312e12), ("float16", 312e12), ("float32", 19.5e12)), 80e9, 2.0e12),
    "H100-80GB": DeviceSpec("H100-80GB", (("bfloat16", 989e12), ("float16", 989e12), ("float8", 1979e12),
                                          ("float32", 67e12)), 80e9, 3.35e12),
    "H800": DeviceSpec("H800", (("bfloat16", 989e12), ("float16", 989e12), ("float8", 1979e12),
                                ("float32", 67e12)), 80e9, 3.35e12),
    "H200": DeviceSpec("H200", (("bfloat16", 989e12), ("float16", 989e12), ("float8", 1979e12),
                                ("float32", 67e12)), 141e9, 4.8e12),
    "B200": DeviceSpec("B200", (("bfloat16", 2250e12), ("float16", 2250e12), ("float8", 4500e12),
                                ("float32", 75e12)), 180e9, 8.0e12),
    "MI300X": DeviceSpec("MI300X", (("bfloat16", 1307.4e12), ("float16", 1307.4e12), ("float8", 2614.9e12),
                                    ("float32", 163.4e12)), 192e9, 5.3e12),
}
DEVICES["H100-SXM"] = replace(DEVICES["H100-80GB"], name="H100-SXM")

# (intra-node link, per-GPU unidirectional; topology of the system's standard 8-GPU node)
_NVLINK3 = LinkSpec(latency_s=5e-6, bandwidth_Bps=300 * GB)       # A100: 600 GB/s bidirectional
_NVLINK4 = LinkSpec(latency_s=5e-6, bandwidth_Bps=450 * GB)       # H100/H200: 900 GB/s bidirectional
_NVLINK4_H800 = LinkSpec(latency_s=5e-6, bandwidth_Bps=200 * GB)  # H800: 400 GB/s bidirectional
_NVLINK5 = LinkSpec(latency_s=5e-6, bandwidth_Bps=900 * GB)       # B200: 1.8 TB/s bidirectional
_XGMI = LinkSpec(latency_s=5e-6, bandwidth_Bps=448 * GB)          # MI300X: 7 x 64 GB/s Infinity Fabric links
_HDR = Topology(nics_per_node=8, nic_bandwidth_Bps=25 * GB, host_memory_bytes=1 * TB, pcie_bandwidth_Bps=12 * GB)
_HDR_2TB = replace(_HDR, host_memory_bytes=2 * TB)
_NDR = Topology(nics_per_node=8, nic_bandwidth_Bps=50 * GB, host_memory_bytes=2 * TB, pcie_bandwidth_Bps=25 * GB)
_LINKS = {"A100-40GB": (_NVLINK3, _HDR), "A100-80GB": (_NVLINK3, _HDR_2TB),
          "H100-80GB": (_NVLINK4, _NDR), "H100-SXM": (_NVLINK4, _NDR), "H200": (_NVLINK4, _NDR),
          "H800": (_NVLINK4_H800, _NDR), "B200": (_NVLINK5, replace(_NDR, host_memory_bytes=4 * TB)),
          "MI300X": (_XGMI, _NDR)}


def preset(device: str, num_nodes: int = 1, devices_per_node: int = 8, topology: Topology = None) -> ClusterSpec:
    """A cluster of ``num_nodes`` nodes of ``devices_per_node`` ``device`` GPUs (NVLink + the system's fabric).

    ``topology`` replaces the system's standard fabric (NICs, rails, leaf size, oversubscription, host RAM)."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}: expected one of {sorted(DEVICES)}")
    intra, fabric = _LINKS[device]
    fabric = topology or replace(fabric, nics_per_node=devices_per_node)      # the system's NIC per GPU
    inter = LinkSpec(latency_s=1e-5, bandwidth_Bps=fabric.nic_share_Bps(devices_per_node))
    return ClusterSpec(f"{num_nodes}x{devices_per_node}:{device}", num_nodes, devices_per_node,
                       DEVICES[device], intra, inter, topology=fabric)


def cluster_of(device: str, devices: int, topology: Topology = None) -> ClusterSpec:
    """``devices`` GPUs of ``device`` in nodes of ``topology.gpus_per_node`` (8 by default); the device count
    must fill whole nodes."""
    per_node = (topology.gpus_per_node if topology and topology.gpus_per_node else 8)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices <= 0:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    if devices % per_node:
        raise ValueError(f"the topology has {per_node} GPUs per node, which does not divide the {devices} devices "
                         f"asked for: give a multiple of {per_node} or a topology whose nodes hold a divisor of it")
    return preset(device, devices // per_node, per_node, topology)


_SPEC = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*:\s*([\w.-]+)\s*$")


def parse_cluster(spec) -> ClusterSpec:
    """``"128x8:A100-80GB"``, a path to a calibrated profile JSON, or a ClusterSpec."""
    if isinstance(spec, ClusterSpec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"expected a cluster spec string like '128x8:A100-80GB' or a ClusterSpec, got {type(spec).__name__}")
    if spec.endswith(".json"):
        return ClusterSpec.from_json(spec)
    m = _SPEC.match(spec)
    if not m:
        raise ValueError(f"malformed cluster spec {spec!r}: expected 'NODESxGPUS:TYPE' like '128x8:A100-80GB' "
                         f"with TYPE one of {sorted(DEVICES)}, or a profile .json")
    nodes, per_node, device = int(m.group(1)), int(m.group(2)), m.group(3)
    if nodes == 0 or per_node == 0:
        raise ValueError(f"cluster spec {spec!r} has zero devices")
    return preset(device, nodes, per_node)


def default_cluster() -> ClusterSpec:
    """``cluster=None`` everywhere: nodes of 8 A100-80GB on NVLink + InfiniBand, every collective native."""
    return preset("A100-80GB", num_nodes=1024, devices_per_node=8)
