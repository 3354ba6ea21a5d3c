"""One-line explanations of reshard steps."""
from __future__ import annotations

from autoparallel.core.collective import Collective
from autoparallel.core.placement import Partial


def explain_step(collective: Collective, mesh_dim: int, src_p, dst_p, n: int) -> str:
    """What one step does, in words (``src_p``/``dst_p`` are the placements of mesh dim ``mesh_dim``)."""
    if n == 1:
        return f"mesh dim {mesh_dim} has one rank: the local tensor is unchanged"
    where = f"the {n} ranks of mesh dim {mesh_dim}"
    if collective == Collective.SLICE and dst_p.is_block_shard():
        return f"keep this rank's piece of each block {list(dst_p.blocks)} of tensor dim {dst_p.dim}, no communication"
    if collective == Collective.ALL_GATHER and src_p.is_block_shard():
        return f"gather tensor dim {src_p.dim} from {where}, then reorder its blocks {list(src_p.blocks)} (local)"
    if collective == Collective.SLICE:
        return f"keep this rank's chunk of tensor dim {dst_p.dim}, no communication"
    if collective == Collective.ALL_GATHER:
        return f"gather tensor dim {src_p.dim} from {where}"
    if collective == Collective.ALL_TO_ALL:
        return f"split tensor dim {dst_p.dim} and concatenate tensor dim {src_p.dim} across {where}"
    if collective == Collective.ALL_REDUCE:
        return f"{src_p.reduce_type}-reduce the partial values over {where}"
    if collective == Collective.REDUCE_SCATTER:
        return f"{src_p.reduce_type}-reduce over {where}, each keeping its chunk of tensor dim {dst_p.dim}"
    if collective == Collective.LOCAL and isinstance(dst_p, Partial):
        keep = "coordinate 0 keeps the value, the others hold zeros" if dst_p.reduce_type == "sum" \
            else "every rank keeps the value"
        return f"mark as a pending {dst_p.reduce_type}-reduction over mesh dim {mesh_dim}: {keep}, no communication"
    if collective == Collective.SEND_RECV:
        return "send each rank's local tensor to the rank at the same mesh coordinate of the destination mesh"
    return collective
