"""paddle.distributed names a user reaches through ``import autoparallel as dist``: the environment queries, and
a clear answer for the names of paddle's API this package does not provide (instead of a bare AttributeError)."""
from __future__ import annotations

import contextlib

__all__ = ["get_world_size", "init_parallel_env", "missing_name_message", "simulate"]


def init_parallel_env():
    """The article's ``dist.init_parallel_env()`` (comm/world.py), which also starts the job's watchdog, as
    ``ap.parallelize`` does (code on some ranks only, a gather inside ``if rank == 0:``, is then named within
    seconds instead of gloo's bare TIMEOUT after 30 s), and routes paddle's ops on distributed tensors from here
    on: ``paddle.as_complex(ap.shard_tensor(...))`` looks ``paddle.as_complex`` up before ``shard_tensor`` (the
    usual installer) runs, so the first distributed call of a script reached paddle's own function."""
    from autoparallel import dispatch_handle, watchdog
    from autoparallel.comm import world

    out = world.init_parallel_env()
    dispatch_handle.install()
    watchdog.start_default()            # a lost, frozen or mismatched rank is named (AP_WATCHDOG=off: none)
    return out


@contextlib.contextmanager
def simulate(world_size: int):
    """Run every rank of a mesh in this process: ``with ap.simulate(world_size=8): ...`` (comm/world.py); routes
    paddle's ops on distributed tensors from the start of the block, as ``init_parallel_env`` does."""
    from autoparallel import dispatch_handle
    from autoparallel.comm import world

    dispatch_handle.install()
    with world.simulate(world_size) as w:
        yield w


def get_world_size() -> int:
    """Ranks in the job (the simulated world's size inside ``ap.simulate``)."""
    from autoparallel.comm.world import current_world

    return current_world().world_size


# paddle.distributed names without a counterpart here -> what to use instead
NOT_PROVIDED = {
    "SequenceParallelBegin": "set strategy.sequence_parallel.enable = True with ap.parallelize, or use "
                             "ap.SequenceParallel / RowWiseParallel(sequence_parallel=True) in a tp_plan",
    "SequenceParallelEnd": "set strategy.sequence_parallel.enable = True with ap.parallelize, or use "
                           "ap.SequenceParallel / RowWiseParallel(sequence_parallel=True) in a tp_plan",
    "SequenceParallelEnable": "use ap.SequenceParallel() for the layer in a tp_plan",
    "SequenceParallelDisable": "use ap.ColWiseParallel / ap.RowWiseParallel(sequence_parallel=True) in a tp_plan",
    "ContextParallel": "context parallelism (ring attention) is not supported",
    "PrepareContextParallel": "context parallelism (ring attention) is not supported",
    "moe_global_mesh_tensor": "expert parallelism is not supported (experts stay replicated)",
    "moe_sub_mesh_tensors": "expert parallelism is not supported (experts stay replicated)",
    "set_mesh": "pass the mesh to each call (shard_tensor, shard_layer, parallelize)",
    "get_mesh": "read it from a distributed tensor (x.mesh) or ap.mesh_of(model)",
    "DistAttr": "use placements (ap.Shard / ap.Replicate / ap.Partial)",
    "auto_parallel": "paddle's auto_parallel module acts on paddle's own distributed tensors; its public functions "
                     "are here at the top level (ap.shard_tensor, ap.dtensor_from_local, ap.dtensor_to_local, "
                     "ap.local_map, ...)",
    # paddle's auto-parallel names whose paddle versions act on paddle's own distributed tensors, not these
    "enable_auto_dp": "data parallelism needs no switch here: ap.parallelize lays the model out and "
                      "ap.shard_dataloader(loader, mesh, shard_dims='data') splits the batch",
    "in_auto_parallel_align_mode": "there is no align mode here: every layout computes one process's values",
    "shard_op": "reshard the inputs (ap.reshard) before the call, or run a per-shard function with ap.local_map",
    "ConvParallel": "spatial (width) parallelism of Conv2D is not supported; convolutions run data parallel",
    "ShardedWeight": "save and load distributed tensors with ap.save_state_dict / ap.load_state_dict",
    "ShardedStateDict": "save and load distributed tensors with ap.save_state_dict / ap.load_state_dict",
    "build_sharded_state_dict": "save and load distributed tensors with ap.save_state_dict / ap.load_state_dict",
    "shard_weight": "save and load distributed tensors with ap.save_state_dict / ap.load_state_dict",
    "flex_checkpoint": "save and load distributed tensors with ap.save_state_dict / ap.load_state_dict",
}


def missing_name_message(name: str) -> str:
    hint = NOT_PROVIDED.get(name)
    if hint is None and not name.startswith("_") and _in_paddle_distributed(name):
        hint = f"it is not re-exported here; call paddle.distributed.{name} itself"
    if hint is None:
        return f"module 'autoparallel' has no attribute {name!r}"
    return f"module 'autoparallel' does not provide paddle.distributed.{name}: {hint}"


def _in_paddle_distributed(name: str) -> bool:
    import sys

    module = sys.modules.get("paddle.distributed")          # only when paddle is loaded already
    return module is not None and hasattr(module, name)
