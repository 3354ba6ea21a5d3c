"""Shared helpers of the rule tests: small meshes and a DistSpec shorthand."""
from autoparallel.mesh import mesh_from_shape
from autoparallel.placement import parse_placements
from autoparallel.spec import DistSpec
from spmd_rules import get_spmd_rule

M1 = mesh_from_shape([2], create_groups=False)
M3 = mesh_from_shape([3], create_groups=False)
M2 = mesh_from_shape([2, 2], create_groups=False)


def S(shape, placements="R", mesh=M1, dtype="float32"):
    return DistSpec(mesh, parse_placements(placements), tuple(shape), dtype)


def rule(name):
    return get_spmd_rule(name)
