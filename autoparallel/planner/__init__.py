"""Planner: cluster specs, model specs, cost model, search, explanation."""
from autoparallel.core.cluster import ClusterSpec, DeviceSpec, LinkSpec, default_cluster, parse_cluster, preset

__all__ = ["ClusterSpec", "DeviceSpec", "LinkSpec", "default_cluster", "parse_cluster", "preset"]
