"""plan_cross_mesh: move a tensor between two meshes (pipeline stages), resharding on either side.

Meshes of the same shape: the cheapest of (reshard on the source mesh to some layout X, send every rank's
X-shard to the rank at the same mesh coordinate, reshard X to the destination layout on the destination mesh),
over every layout X. Meshes of different shapes: replicate on the source mesh, send the whole tensor (the
destination rank at flat position k receives from source flat position k % source size), then reshard from
replicated on the destination mesh.
"""
from __future__ import annotations

from autoparallel.core.cluster import ClusterSpec
from autoparallel.core.collective import Collective
from autoparallel.core.cost import emulated_bytes
from autoparallel.core.mesh import ProcessMesh
from autoparallel.core.placement import Replicate, format_placements
from autoparallel.core.spec import DistSpec
from reshard import cache
from reshard.explain import explain_step
from reshard.plan import ReshardPlan, ReshardStep
from reshard.program import whole_pairs
from reshard.planner import cached_plan, plan_reshard, pricer, state_graph
from reshard.pricing import slowest_seconds
from reshard.search import distances, near
from reshard.transitions import partial_targets
from reshard.validate import check_cluster, check_dtype, check_mesh, check_placements_for, check_shape


def plan_cross_mesh(global_shape, dtype, src_mesh: ProcessMesh, src_placements, dst_mesh: ProcessMesh,
                    dst_placements, cluster=None) -> ReshardPlan:
    """Cheapest plan taking a tensor from ``src_placements`` on ``src_mesh`` to ``dst_placements`` on ``dst_mesh``."""
    check_mesh(src_mesh, "src_mesh")
    check_mesh(dst_mesh, "dst_mesh")
    shape = check_shape(global_shape)
    dtype = check_dtype(dtype)
    src = check_placements_for("src_placements", src_mesh, src_placements, len(shape))
    dst = check_placements_for("dst_placements", dst_mesh, dst_placements, len(shape))
    cluster = check_cluster(cluster)
    if src_mesh == dst_mesh:
        return plan_reshard(shape, dtype, src_mesh, src, dst, cluster)
    return cached_cross(shape, dtype, src_mesh, src, dst_mesh, dst, cluster)


def cached_cross(shape: tuple, dtype: str, src_mesh: ProcessMesh, src: tuple, dst_mesh: ProcessMesh,
                 dst: tuple, cluster: ClusterSpec) -> ReshardPlan:
    """plan_cross_mesh on validated inputs, through the reshard cache."""
    return cache.memo(("cross", shape, dtype, src_mesh, src, dst_mesh, dst, cluster),
                      lambda: _cross(shape, dtype, src_mesh, src, dst_mesh, dst, cluster))


def _cross(shape: tuple, dtype: str, src_mesh: ProcessMesh, src: tuple, dst_mesh: ProcessMesh,
           dst: tuple, cluster: ClusterSpec) -> ReshardPlan:
    if src_mesh.shape != dst_mesh.shape:
        return _via_replicate(shape, dtype, src_mesh, src, dst_mesh, dst, cluster)
    targets = partial_targets(dst)
    d_src = distances(state_graph(shape, dtype, src_mesh, cluster, src, targets).adj, src)
    d_dst = distances(state_graph(shape, dtype, dst_mesh, cluster, src, targets).radj, dst)
    send = {x: _send(shape, dtype, src_mesh, dst_mesh, x, x, cluster) for x in d_src if x in d_dst}
    total = {x: d_src[x] + send[x].seconds + d_dst[x] for x in send}
    best = min(total.values())
    options = []
    for x in sorted((x for x in total if near(total[x], best)), key=format_placements):
        before = cached_plan(shape, dtype, src_mesh, src, x, cluster).steps
        after = cached_plan(shape, dtype, dst_mesh, x, dst, cluster).steps
        steps = before + (send[x],) + after
        options.append(((len(steps), tuple(format_placements(s.dst) for s in steps)), steps))
    steps = min(options, key=lambda o: o[0])[1]
    return ReshardPlan(DistSpec(src_mesh, src, shape, dtype), DistSpec(dst_mesh, dst, shape, dtype), steps,
                       cluster.backend)


def _via_replicate(shape, dtype, src_mesh, src, dst_mesh, dst, cluster) -> ReshardPlan:
    rep_src, rep_dst = (Replicate(),) * src_mesh.ndim, (Replicate(),) * dst_mesh.ndim
    steps = (cached_plan(shape, dtype, src_mesh, src, rep_src, cluster).steps
             + (_send(shape, dtype, src_mesh, dst_mesh, rep_src, rep_dst, cluster),)
             + cached_plan(shape, dtype, dst_mesh, rep_dst, dst, cluster).steps)
    return ReshardPlan(DistSpec(src_mesh, src, shape, dtype), DistSpec(dst_mesh, dst, shape, dtype), steps,
                       cluster.backend)


def _send(shape, dtype, src_mesh, dst_mesh, state, dst_state, cluster) -> ReshardStep:
    """Every destination rank at flat position k receives the local tensor of source position k % size."""
    b = pricer(shape, dtype, src_mesh, cluster).local_nbytes(state)
    src_ids, dst_ids = src_mesh.process_ids, dst_mesh.process_ids
    if src_mesh.shape == dst_mesh.shape:
        pairs = [(src_ids[k % len(src_ids)], r) for k, r in enumerate(dst_ids)]
    else:                                                   # whole tensors; a rank in both meshes keeps its own
        pairs = [p for p in whole_pairs(src_ids, dst_ids) if p[0] != p[1]]
    per_source = {}
    for s, _ in pairs:
        per_source[s] = per_source.get(s, 0) + 1
    sends = max(per_source.values(), default=0)             # messages the busiest source rank sends
    links = tuple(dict.fromkeys(cluster.link_for(p) for p in pairs))
    seconds = slowest_seconds(Collective.SEND_RECV, b, 2, links, cluster.backend) if pairs else 0.0
    nbytes = emulated_bytes(Collective.SEND_RECV, b, 2, cluster.backend)
    if src_mesh.shape == dst_mesh.shape:
        text = explain_step(Collective.SEND_RECV, -1, None, None, 2)
    else:
        text = (f"destination rank k receives the whole tensor from source rank k % {len(src_ids)}, a rank of "
                f"both meshes keeps its own ({sends} send{'s' if sends != 1 else ''} per source rank)")
    return ReshardStep(Collective.SEND_RECV, -1, state, dst_state, float(sends * nbytes), float(sends * seconds),
                       None, text, src_mesh, dst_mesh)
