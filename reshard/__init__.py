"""Cost-driven reshard planning: the cheapest path between two layouts of a tensor.

Pure: placements, specs, meshes and cluster specs in, a ``ReshardPlan`` out; no paddle, no process groups.
Each step names its ``Collective``; ``compile_plan`` turns a plan into per-group calls for the runtime.
"""
from autoparallel.core.collective import Collective
from reshard.cache import bump_epoch, clear_cache, cluster_epoch
from reshard.cross_mesh import plan_cross_mesh
from reshard.plan import COLLECTIVES, ReshardPlan, ReshardStep
from reshard.planner import plan_reshard
from reshard.program import StepProgram, compile_plan

__all__ = ["COLLECTIVES", "Collective", "ReshardPlan", "ReshardStep", "StepProgram", "bump_epoch", "clear_cache",
           "cluster_epoch", "compile_plan", "plan_cross_mesh", "plan_reshard"]
