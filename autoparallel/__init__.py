"""autoparallel: semi-automatic parallel training for paddle.

Public names are loaded lazily, so pure parts (placements, specs, planning) import without paddle.
"""
from __future__ import annotations

import importlib
import sys
import types

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # layouts
    "Shard": "autoparallel.placement", "Replicate": "autoparallel.placement", "Partial": "autoparallel.placement",
    "BlockShard": "autoparallel.placement",
    "Placement": "autoparallel.placement", "parse_placement": "autoparallel.placement",
    "parse_placements": "autoparallel.placement",
    "ProcessMesh": "autoparallel.mesh", "DistSpec": "autoparallel.spec",
    # distributed tensors
    "DistTensor": "autoparallel.dist_tensor", "DistParameter": "autoparallel.dist_tensor",
    "shard_tensor": "autoparallel.api_tensor", "reshard": "autoparallel.api_tensor",
    "dtensor_from_local": "autoparallel.api_tensor", "is_dist": "autoparallel.dist_tensor",
    "dtensor_to_local": "autoparallel.api_tensor", "dtensor_from_fn": "autoparallel.api_tensor",
    "unshard_dtensor": "autoparallel.api_tensor", "ReduceType": "autoparallel.placement",
    "full_state_dict": "autoparallel.export_forms", "full_model": "autoparallel.export_forms",
    "ShardedExportError": "autoparallel.export_save",
    "SplitPoint": "autoparallel.api_parallelize",
    "shard_dataloader": "autoparallel.api_data", "ShardDataloader": "autoparallel.api_data",
    "shard_scaler": "autoparallel.api_layer", "get_world_size": "autoparallel.api_env",
    "LocalLayer": "autoparallel.api_local", "local_map": "autoparallel.api_local",
    "PrepareLayerInput": "autoparallel.api_prepare", "PrepareLayerOutput": "autoparallel.api_prepare",
    # worlds
    "simulate": "autoparallel.api_env", "current_world": "autoparallel.comm.world",
    "get_rank": "autoparallel.comm.world", "init_parallel_env": "autoparallel.api_env",
    # planning
    "ClusterSpec": "autoparallel.planner.cluster",
    "plan": "autoparallel.planner.api",
    # strategy and runtime
    "Strategy": "autoparallel.strategy",
    "shard_layer": "autoparallel.api_layer", "shard_optimizer": "autoparallel.parallel.optimizer",
    "apply_tp": "autoparallel.parallel.tensor_parallel", "reduce_gradients": "autoparallel.parallel.grads",
    "local_mode": "autoparallel.local_mode", "custom_op": "autoparallel.dispatch", "set_cluster": "autoparallel.comm.world",
    "mesh_of": "autoparallel.layer_state", "chosen_strategy": "autoparallel.layer_state",
    "chosen_plan": "autoparallel.layer_state", "init_report": "autoparallel.layer_state",
    "install": "autoparallel.dispatch_handle", "uninstall": "autoparallel.dispatch_handle",
    "dispatch_mode": "autoparallel.dispatch_handle", "DispatchHandle": "autoparallel.dispatch_handle",
    "ColWiseParallel": "autoparallel.parallel.tensor_parallel", "RowWiseParallel": "autoparallel.parallel.tensor_parallel",
    "VocabParallelEmbedding": "autoparallel.parallel.tensor_parallel",
    "SequenceParallel": "autoparallel.parallel.tensor_parallel",
    "FusedColWiseParallel": "autoparallel.parallel.tp_plans",
    "parallelize": "autoparallel.parallelize", "trace": "autoparallel.graph.trace",
    "to_distributed": "autoparallel.api_to_distributed", "ToDistributedConfig": "autoparallel.api_to_distributed",
    "DataParallel": "autoparallel.parallelize", "Optimizer": "autoparallel.parallelize",
    "parallel_guard": "autoparallel.parallelize", "recompute_layers": "autoparallel.parallel.recompute",
    "DistributedDataLoader": "autoparallel.data", "ByteTextDataset": "autoparallel.data",
    "save_state_dict": "autoparallel.checkpoint.save", "load_state_dict": "autoparallel.checkpoint.load",
    "load_merged_state_dict": "autoparallel.checkpoint.load", "PerformanceMonitor": "autoparallel.monitor",
    "Watchdog": "autoparallel.watchdog", "reconfigure": "autoparallel.checkpoint.reshard_state",
    "CheckpointManager": "autoparallel.checkpoint.manager", "training_state": "autoparallel.checkpoint.state",
    "to_static": "autoparallel.api_layer", "DistModel": "autoparallel.graph.to_static",
    "complete": "autoparallel.graph.completion",
    "apply_pp": "autoparallel.parallel.pipeline.runtime", "PipelineModule": "autoparallel.parallel.pipeline.runtime",
    "materialize": "autoparallel.lazy_init.params",
    "profile": "autoparallel.profiler",
    "register_spmd_rule": "spmd_rules.registry", "get_spmd_rule": "spmd_rules.registry",
    "ShardingStage1": "autoparallel.parallel.sharding_stages", "ShardingStage2": "autoparallel.parallel.sharding_stages",
    "ShardingStage3": "autoparallel.parallel.sharding_stages",
    "resume_from_last_checkpoint": "autoparallel.recovery", "fallback_to_cpu_offload": "autoparallel.recovery",
    "reconfigure_distributed_model": "autoparallel.recovery",
}

__all__ = sorted(_EXPORTS)

if "paddle" in sys.modules:          # record the creation order of parameters built under paddle.LazyGuard
    from autoparallel.lazy_init import order as _order

    _order.install()

if "paddle" in sys.modules:          # paddle.amp.GradScaler over distributed losses and ap optimizers
    from autoparallel.parallel import amp_scaler as _amp_scaler

    _amp_scaler.install()

# paddle.distributed.load_state_dict / load_merged_state_dict of a checkpoint autoparallel wrote, in a process that
# has made no other autoparallel call: routed from the import on (paddle imported first, or when it is).
if "paddle" in sys.modules:
    from autoparallel import dcp_forms as _dcp_forms

    _dcp_forms.install()
else:
    from autoparallel import after_import as _after_import

    _after_import.watch("paddle", lambda: importlib.import_module("autoparallel.dcp_forms").install())

def _install_param_carry() -> None:
    """Install param_carry once paddle is imported; when autoparallel.compat is what imported paddle, at the end of
    compat's own import (param_carry needs compat's names)."""
    compat = sys.modules.get("autoparallel.compat")
    if compat is not None and not hasattr(compat, "SideData"):
        compat.AFTER_LOAD.append(_install_param_carry)
        return
    importlib.import_module("autoparallel.param_carry").install()


# gradient hooks registered on a parameter (a layer's __init__) reach the distributed parameter replacing it
if "paddle" in sys.modules:
    from autoparallel import param_carry as _param_carry

    _param_carry.install()
else:
    _after_import.watch("paddle", lambda: _install_param_carry())


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    from autoparallel.api_env import missing_name_message

    raise AttributeError(missing_name_message(name))


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


# ``parallelize`` and ``local_mode`` are public functions sharing their name with a submodule; importing such a
# module (``from autoparallel.parallelize import ...``) makes the import system set the package attribute to the
# module, so ``ap.parallelize`` would become the module. The package keeps answering with the exported function.
class _Package(types.ModuleType):
    def __getattribute__(self, name):
        value = super().__getattribute__(name)
        if isinstance(value, types.ModuleType) and name in _EXPORTS:
            return getattr(importlib.import_module(_EXPORTS[name]), name)
        return value


sys.modules[__name__].__class__ = _Package
