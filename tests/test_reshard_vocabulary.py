"""One reshard vocabulary: the planner names each step's Collective once, the runtime runs it by lookup."""
import itertools

import numpy as np
import pytest

import autoparallel as ap
from autoparallel.core.cluster import parse_cluster
from autoparallel.core.collective import Collective
from autoparallel.core.mesh import mesh_from_shape
from autoparallel.core.spec import DistSpec
from reshard import COLLECTIVES, ReshardPlan, ReshardStep, compile_plan, plan_cross_mesh, plan_reshard

MESH = mesh_from_shape([2, 4], create_groups=False)
STATES = [",".join(s) for s in itertools.product(["R", "S(0)", "S(1)", "P"], repeat=2)]


def _plans():
    for src, dst in itertools.product(STATES, STATES):
        yield plan_reshard([8, 12], "float32", MESH, src, dst, parse_cluster("2x4:A100-80GB"))


def test_every_planned_step_names_a_collective_that_fits_its_placements():
    seen = set()
    for plan in _plans():
        for step, prog in zip(plan.steps, plan.program):
            assert type(step.collective) is Collective and prog.collective is step.collective
            assert prog.form in (None, (step.collective, type(step.src_placement), type(step.dst_placement)))
            p, q = step.src_placement, step.dst_placement
            kinds = (type(p).__name__, type(q).__name__)
            assert kinds == {"slice": ("Replicate", "Shard"), "all_gather": ("Shard", "Replicate"),
                             "all_reduce": ("Partial", "Replicate"), "reduce_scatter": ("Partial", "Shard"),
                             "all_to_all": ("Shard", "Shard"), "local": ("Replicate", "Partial")}[step.collective]
            seen.add(step.collective)
    assert seen == set(COLLECTIVES) - {Collective.SEND_RECV}


def test_names_convert_and_unknown_names_are_refused():
    r, s0 = (ap.Replicate(), ap.Replicate()), (ap.Shard(0), ap.Replicate())
    step = ReshardStep("slice", 0, r, s0, 0.0, 0.0)
    assert step.collective is Collective.SLICE and step.collective == "slice" and repr(step.collective) == "'slice'"
    with pytest.raises(ValueError, match=r"a reshard step runs one of \['slice', 'all_gather'.*got 'gather'"):
        ReshardStep("gather", 0, s0, r, 0.0, 0.0)


def test_a_step_whose_collective_does_not_fit_is_refused_when_compiled():
    r, s0 = (ap.Replicate(), ap.Replicate()), (ap.Shard(0), ap.Replicate())
    spec = DistSpec(MESH, s0, (8, 12))
    bad = ReshardPlan(spec, spec.with_placements(r), (ReshardStep("all_reduce", 0, s0, r, 0.0, 0.0),))
    with pytest.raises(ValueError, match=r"^all_reduce on mesh dim 0 runs on P -> R, got S\(0\) -> R"):
        compile_plan(bad)
    good = ReshardPlan(spec, spec.with_placements(r), (ReshardStep("all_gather", 0, s0, r, 0.0, 0.0),))
    (prog,) = compile_plan(good)
    # every group of mesh dim 0 (ranks k and k + 4) gathers tensor dim 0 from chunks of 4 rows
    assert prog.calls == tuple(((k, k + 4), (0, [4, 4])) for k in range(4))


def test_uneven_chunks_are_compiled_from_the_specs():
    plan = plan_reshard([7, 5], "float32", mesh_from_shape([4], create_groups=False), "S(0)", "S(1)")
    assert plan.collectives == ["all_to_all"]
    (prog,) = plan.program
    assert prog.calls == (((0, 1, 2, 3), (0, 1, [2, 2, 2, 1], [2, 2, 1, 0])),)
    assert plan.program is plan.program            # compiled once per plan


def test_executor_table_covers_the_vocabulary_and_runs_by_lookup(monkeypatch):
    import paddle

    from autoparallel import redistribute, reshard_exec

    assert redistribute is reshard_exec
    from reshard.program import CALLS

    assert set(reshard_exec.EXECUTORS) == set(Collective)
    assert set(reshard_exec.GROUP_EXECUTORS) == set(CALLS)      # every compiled form has its executor
    form = (Collective.ALL_TO_ALL, ap.Shard, ap.Shard)
    ran = []
    original = reshard_exec.GROUP_EXECUTORS[form]

    def spy(held, ranks, args, for_split):
        ran.append((tuple(ranks), args))
        return original(held, ranks, args, for_split)

    monkeypatch.setitem(reshard_exec.GROUP_EXECUTORS, form, spy)
    mesh = mesh_from_shape([4])
    x = np.arange(35, dtype="float32").reshape(7, 5)
    with ap.simulate(4):
        y = ap.reshard(ap.shard_tensor(paddle.to_tensor(x), mesh, [ap.Shard(0)]), mesh, [ap.Shard(1)])
        assert np.array_equal(y.full().numpy(), x)
        assert [t.shape for _, t in sorted(y.locals.items())] == [[7, 2], [7, 2], [7, 1], [7, 0]]
    assert ran == [((0, 1, 2, 3), (0, 1, [2, 2, 2, 1], [2, 2, 1, 0]))]


def test_cross_mesh_steps_send_by_coordinate():
    import paddle

    a, b = mesh_from_shape([2]), ap.ProcessMesh([2, 3])
    plan = plan_cross_mesh([4, 6], "float32", a, "S(1)", b, "S(1)")
    assert plan.collectives == ["send_recv"]
    assert plan.program[0].calls[0][0] == ((0, 2), (1, 3))
    x = np.arange(24, dtype="float32").reshape(4, 6)
    with ap.simulate(4):
        y = ap.reshard(ap.shard_tensor(paddle.to_tensor(x), a, [ap.Shard(1)]), b, [ap.Shard(1)])
        assert sorted(y.locals) == [2, 3] and np.array_equal(y.full().numpy(), x)
