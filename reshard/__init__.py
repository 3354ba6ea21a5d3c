"""Cost-driven redistribution planning: the cheapest path between two layouts of a tensor.

Pure: placements, specs, meshes and cluster specs in, a ``ReshardPlan`` out; no paddle, no process groups.
"""
from reshard.cross_mesh import plan_cross_mesh
from reshard.plan import COLLECTIVES, ReshardPlan, ReshardStep
from reshard.planner import plan_reshard

__all__ = ["COLLECTIVES", "ReshardPlan", "ReshardStep", "plan_cross_mesh", "plan_reshard"]
