"""Process groups per mesh dim, created with the mesh in one fixed order on every rank.

gloo fails when disjoint ``new_group`` calls interleave with other collectives, so every rank creates
every group of every mesh dim (row-major over the other dims), each followed by a barrier. Groups are
cached by their rank tuple, so meshes sharing a group share one paddle Group.
"""
from __future__ import annotations

_GROUPS: dict = {}          # tuple(ranks) -> paddle Group


def _dist_ready() -> bool:
    try:
        import paddle.distributed as dist
    except ImportError:
        return False
    return dist.is_initialized() and dist.get_world_size() > 1


def on_mesh_created(mesh) -> None:
    """Create the communication groups of every mesh dim (real multi-process world only)."""
    from autoparallel.comm.world import current_world

    if current_world().is_simulated or not _dist_ready():
        return
    import paddle.distributed as dist

    world = dist.get_world_size()
    if max(mesh.process_ids) >= world:
        raise ValueError(f"mesh {mesh.mesh.tolist()} names rank {max(mesh.process_ids)} but the world has "
                         f"{world} ranks (0..{world - 1})")
    todo = []
    everyone = tuple(range(world))
    for d in range(mesh.ndim):
        for ranks in mesh.all_groups(d):
            key = tuple(ranks)
            if tuple(sorted(key)) == everyone:
                _GROUPS[key] = None      # the default group: a second whole-world gloo group can fail to
                continue                 # connect once smaller groups exist
            if len(key) > 1 and key not in _GROUPS and key not in todo:
                todo.append(key)
    if not todo:
        return
    dist.barrier()                 # arrive together: gloo's connect times out on stragglers
    for key in todo:
        _GROUPS[key] = dist.new_group(list(key))
        dist.barrier()


def get_group(ranks):
    """The paddle Group for ``ranks`` (created with its mesh); None for the whole world."""
    import paddle.distributed as dist

    key = tuple(ranks)
    if key in _GROUPS:
        return _GROUPS[key]
    if sorted(key) == list(range(dist.get_world_size())):
        return None
    raise RuntimeError(f"no communication group for ranks {list(key)}: groups are created with their "
                       f"ProcessMesh on every rank; create the mesh on all ranks before communicating")
