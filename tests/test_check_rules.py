"""spmd_rules.validation (python -m spmd_rules.validation): every rule passes; wrong rules (forward or backward) and missing rules are caught."""
import io

import numpy as np
import pytest

pytest.importorskip("paddle")
import spmd_rules.validation as check_rules  # noqa: E402

from autoparallel.mesh import mesh_from_shape  # noqa: E402
from autoparallel.placement import Partial, Replicate, Shard  # noqa: E402
from autoparallel.spec import DistSpec  # noqa: E402

import spmd_rules  # noqa: E402
from spmd_rules import SpmdResult, get_spmd_rule, register_spmd_rule  # noqa: E402


def run(*argv):
    out = io.StringIO()
    code = check_rules.main(list(argv), out=out)
    return code, out.getvalue()


@pytest.fixture
def scratch(scratch_rule):
    yield scratch_rule
    for n in scratch_rule:
        check_rules.CASES.pop(n, None)
        check_rules.IMPLS.pop(n, None)


def test_all_rules_pass():
    code, out = run("--all")
    assert code == 0, out
    assert "0 failing" in out and "0 unchecked" in out and "NO RULE" not in out
    assert "need runtime" in out          # collective / random local ops are counted, not passed


def test_broken_matmul_is_caught(scratch):
    """Negative control: a matmul rule claiming S(0) output for a contracted shard."""
    scratch.append("broken_matmul")
    good = get_spmd_rule("matmul")

    @register_spmd_rule("broken_matmul")
    def broken(x, y, transpose_x=False, transpose_y=False, name=None):
        res = good(x, y, transpose_x, transpose_y)
        outs = tuple(o.with_placements(tuple(Shard(0) if p.is_partial() else p for p in o.placements))
                     for o in res.outputs)
        return SpmdResult(res.inputs, outs)

    check_rules._build_cases()
    check_rules.CASES["broken_matmul"] = check_rules.CASES["matmul"][:1]
    check_rules.IMPLS["broken_matmul"] = check_rules.resolve("paddle.matmul")
    code, out = run("--op", "broken_matmul")
    assert code == 1
    assert "WRONG: broken_matmul" in out and "(S(1), S(0)) -> S(0)" in out
    code, out = run("--op", "matmul")
    assert code == 0, out


def test_wrong_backward_is_caught(scratch):
    """An op whose forward shards like relu but whose gradient depends on the local row count."""
    import paddle

    class RowScaled(paddle.autograd.PyLayer):
        @staticmethod
        def forward(ctx, x):
            ctx.rows = x.shape[0]
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * ctx.rows

    scratch.append("row_scaled")
    register_spmd_rule("row_scaled", lambda x: get_spmd_rule("relu")(x))
    check_rules.add_case("row_scaled", check_rules.f(5, 6), impl=RowScaled.apply)
    code, out = run("--op", "row_scaled")
    assert code == 1 and "gradient of input 0" in out


def test_wrong_local_attrs_are_caught(scratch):
    scratch.append("reshape_no_local_shape")
    good = get_spmd_rule("reshape")
    register_spmd_rule("reshape_no_local_shape",
                       lambda x, shape, name=None: SpmdResult(good(x, shape).inputs, good(x, shape).outputs))
    check_rules._build_cases()
    check_rules.CASES["reshape_no_local_shape"] = check_rules.CASES["reshape"][:1]
    check_rules.IMPLS["reshape_no_local_shape"] = check_rules.resolve("paddle.reshape")
    code, out = run("--op", "reshape_no_local_shape")
    assert code == 1 and "WRONG: reshape_no_local_shape" in out


def test_missing_rule_and_missing_cases_are_reported(scratch):
    code, out = run("--op", "no_such_op")
    assert code == 1 and "NO RULE: no_such_op" in out and "register_spmd_rule" in out
    scratch.append("uncovered_op")
    register_spmd_rule("uncovered_op", lambda x: get_spmd_rule("relu")(x))
    code, out = run("--op", "uncovered_op")
    assert code == 1 and "unchecked" in out


def test_runtime_local_ops_are_counted_separately():
    outcome = check_rules.check_op("cross_entropy")
    assert not outcome.failures
    assert outcome.needs_runtime > 0 and outcome.checked > 0
    assert {"vocab_parallel_cross_entropy", "global_mean_cross_entropy"} <= outcome.runtime_ops


def test_partial_terms_and_assembly_round_trip():
    mesh = mesh_from_shape([2, 2], create_groups=False)
    full = np.random.default_rng(0).standard_normal((5, 6))
    for pl in [(Partial("sum"), Shard(1)), (Shard(0), Shard(0)), (Partial("max"), Replicate()),
               (Partial("min"), Partial("sum")), (Replicate(), Partial("avg"))]:
        spec = DistSpec(mesh, pl, full.shape, "float64")
        locals_ = {c: check_rules.local_input(full, spec, c, "k") for c in np.ndindex(2, 2)}
        for c, a in locals_.items():
            assert a.shape == spec.local_shape(c)
        np.testing.assert_allclose(check_rules.assemble(locals_, spec, 1e-12, 1e-12), full, rtol=1e-12, atol=1e-12)
    bad = {c: np.full((5, 6), float(c[0])) for c in np.ndindex(2, 2)}
    with pytest.raises(AssertionError, match="differ"):
        check_rules.assemble(bad, DistSpec(mesh, (Replicate(), Replicate()), (5, 6), "float64"), 1e-9, 1e-9)


def test_list_and_cli_errors():
    code, out = run("--list")
    assert code == 0 and "matmul" in out.split()
    with pytest.raises(SystemExit):
        check_rules.main([], out=io.StringIO())
