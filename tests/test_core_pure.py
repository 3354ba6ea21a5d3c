"""The pure core: autoparallel.core, spmd_rules, reshard and the planner import and work with paddle blocked;
the old module paths name the very same modules."""
import subprocess
import sys

BLOCKED = '''
import importlib, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "paddle" or name.startswith("paddle."):
            raise ImportError("paddle is blocked: " + name)
sys.meta_path.insert(0, Block())
'''

PURE = '''
for name in ("autoparallel.core", "autoparallel.core.cluster", "autoparallel.core.cost", "autoparallel.core.spec",
             "autoparallel.core.collective", "autoparallel.core.capabilities", "autoparallel.core.topology",
             "spmd_rules", "reshard", "reshard.cli", "autoparallel.planner", "autoparallel.planner.api",
             "autoparallel.planner.search", "autoparallel.planner.cost_model", "autoparallel.planner.explain"):
    importlib.import_module(name)
from autoparallel.core.mesh import ProcessMesh
from autoparallel.core.cluster import parse_cluster
from autoparallel.core.spec import DistSpec
from reshard import plan_reshard
from spmd_rules import get_spmd_rule
mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])      # groups are made only once paddle is loaded
plan = plan_reshard([8, 8], "float32", mesh, "S(0),P", "R,R", parse_cluster("1x4:A100-80GB"))
print(plan.collectives)
x, w = DistSpec(mesh, "S(0),R", (8, 4)), DistSpec(mesh, "R,S(0)", (4, 6))
print(get_spmd_rule("matmul").fn(x, w).outputs[0].placements)
try:
    importlib.import_module("autoparallel.dist_tensor")        # negative control: the blocker works
except ImportError as e:
    print("runtime blocked:", e)
print("paddle" in sys.modules)
'''


def test_core_rules_reshard_and_planner_need_no_paddle():
    out = subprocess.run([sys.executable, "-c", BLOCKED + PURE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "['all_reduce', 'all_gather']"
    assert lines[1] == "(S(0), P(sum))"
    assert lines[2].startswith("runtime blocked: paddle is blocked")
    assert lines[3] == "False"


def test_old_paths_are_the_core_modules():
    import autoparallel.comm.capabilities
    import autoparallel.comm.cost
    import autoparallel.core as core
    import autoparallel.mesh
    import autoparallel.placement
    import autoparallel.planner.cluster
    import autoparallel.planner.topology
    import autoparallel.spec
    from autoparallel.core import capabilities, cluster, cost, mesh, placement, spec, topology

    assert autoparallel.placement is placement and autoparallel.mesh is mesh and autoparallel.spec is spec
    assert autoparallel.planner.cluster is cluster and autoparallel.planner.topology is topology
    assert autoparallel.comm.cost is cost and autoparallel.comm.capabilities is capabilities
    assert core.placement.Shard(0) == autoparallel.placement.Shard(0)
    from autoparallel.planner.cluster import ClusterSpec
    from autoparallel.placement import _TOKEN            # private names too: one module object, not a copy
    assert ClusterSpec is cluster.ClusterSpec and _TOKEN is placement._TOKEN
