"""Process groups per mesh dim, created with the mesh in one fixed order on every rank.

gloo fails when disjoint ``new_group`` calls interleave with other collectives, so every rank creates
every group of every mesh dim (row-major over the other dims), each followed by a barrier. Groups are
cached by their rank tuple, so meshes sharing a group share one paddle Group.
"""
from __future__ import annotations

import itertools
import os
import socket

_GROUPS: dict = {}          # tuple(ranks) -> paddle Group
_STORE_FIX = [False]


def install_group_store_fix() -> None:
    """Give every new gloo group its own TCPStore (idempotent; real multi-process jobs only; groups of another
    backend are made by paddle as they are).

    paddle 3.3.1 connects every gloo group's full mesh through the same keys ("0", "1", ...) of the one
    global TCPStore, so a rank can read an address an earlier group left there and fail with
    "Connection refused" or hang until gloo's TIMEOUT (about 40% of 4-rank launches here). The group's
    lowest rank serves a fresh store on a free port and publishes its address under a per-call key.
    """
    if _STORE_FIX[0] or "PADDLE_TRAINER_ENDPOINTS" not in os.environ:
        return
    import paddle.distributed as dist
    from autoparallel.compat import TCPStore, default_store, set_default_store

    original, counter = dist.new_group, itertools.count()
    hosts = [e.rsplit(":", 1)[0] for e in os.environ["PADDLE_TRAINER_ENDPOINTS"].split(",")]

    def new_group(ranks=None, *args, **kwargs):
        ranks = sorted(ranks if ranks is not None else range(dist.get_world_size()))
        key, rank, lead = f"ap_group_store/{next(counter)}", dist.get_rank(), ranks[0]
        default = default_store()
        if rank not in ranks or len(ranks) == 1 or default is None or not _on_gloo(dist):
            return original(ranks, *args, **kwargs)
        if rank == lead:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            default.set(key, f"{hosts[lead]}:{port}".encode())      # publish before serving
            store = TCPStore(hosts[lead], port, True, len(ranks), 900)
        else:
            host, port = bytes(default.get(key)).decode().rsplit(":", 1)
            store = TCPStore(host, int(port), False, len(ranks), 900)
        set_default_store(store)
        try:
            return original(ranks, *args, **kwargs)
        finally:
            set_default_store(default)

    from autoparallel import patches

    new_group.__wrapped__ = original
    patches.patch(dist, "new_group", new_group)         # undone by ap.uninstall()
    patches.on_undo(_reset_store_fix)
    _STORE_FIX[0] = True


def _on_gloo(dist) -> bool:
    """Whether the job's groups are gloo's (the store collision is gloo's; NCCL and the other backends read the
    store their own way and keep paddle's)."""
    try:
        return str(dist.get_backend()).lower() == "gloo"
    except RuntimeError:                        # this rank is outside the global group
        return True


def _reset_store_fix() -> None:
    _STORE_FIX[0] = False


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

    install_group_store_fix()

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


def ensure_pair_groups(pairs) -> None:
    """The two-rank group of every ``(rank, rank)`` pair that sends (a cross-mesh reshard's messages and the
    gradients going back), made now on every rank in one order: every rank runs the reshard that asks."""
    if not _dist_ready():
        return
    import paddle.distributed as dist

    everyone = list(range(dist.get_world_size()))
    for pair in pairs:
        key = tuple(sorted(pair))
        if key[0] == key[1] or key in _GROUPS or list(key) == everyone:
            continue
        dist.barrier()
        _GROUPS[key] = dist.new_group(list(key))
        dist.barrier()


def get_group(ranks):
    """The paddle Group for ``ranks`` (created with its mesh); None for the whole world."""
    import paddle.distributed as dist

    key = tuple(ranks)
    if key in _GROUPS:
        return _GROUPS[key]
    world = dist.get_world_size()
    if sorted(key) == list(range(world)):
        return None
    if max(key) >= world:
        raise ValueError(f"a collective over ranks {list(key)}, but this job has {world} rank(s) (0..{world - 1}): "
                         f"the mesh is bigger than the world; start {max(key) + 1} ranks with python -m "
                         f"paddle.distributed.launch --nproc_per_node {max(key) + 1} (or paddle.distributed.spawn), "
                         f"or run every rank in this process with ap.simulate(world_size={max(key) + 1})")
    raise RuntimeError(f"no communication group for ranks {list(key)}: groups are created with their "
                       f"ProcessMesh on every rank once paddle.distributed is initialised; create the mesh on all "
                       f"ranks, after paddle.distributed.init_parallel_env(), before communicating")
