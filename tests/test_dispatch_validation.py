"""A rule is checked against the op the first time a call signature is planned: output count, shape and
dtype; a rule that raises is named with the op and the input specs; custom_op rejects bad arguments;
a value-dependent shape cannot be traced."""
import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel import dispatch_cache
from autoparallel.mesh import mesh_from_shape
from spmd_rules import SpmdResult, get_spmd_rule, register_spmd_rule
from spmd_rules.errors import DataDependentShapeError

R, S = ap.Replicate(), ap.Shard


@pytest.fixture
def override_relu():
    good = get_spmd_rule("relu")
    dispatch_cache.clear()
    yield
    register_spmd_rule("relu", good.fn, reverse=good.reverse_fn)
    dispatch_cache.clear()


def _x():
    mesh = mesh_from_shape([2], ["x"])
    return ap.shard_tensor(paddle.to_tensor(np.arange(12, dtype="float32").reshape(4, 3) - 5), mesh, [S(0)])


@pytest.mark.parametrize("bad,err,match", [
    (lambda x: SpmdResult([x], [x.with_placements((R,))]), ValueError, r"declared float32\[4, 3\] \[R\]"),
    (lambda x: SpmdResult([x], [ap.DistSpec(x.mesh, (S(0),), (4, 3), "float64")]), ValueError, "produced float32"),
    (lambda x: SpmdResult([x], [ap.DistSpec(x.mesh, (S(0),), (4, 6), "float32")]), ValueError, r"\[4, 6\]"),
    (lambda x: SpmdResult([x], [x, x]), TypeError, "returned 2 output spec"),
])
def test_a_wrong_rule_is_caught_on_the_first_call_and_never_cached(override_relu, bad, err, match):
    register_spmd_rule("relu", lambda x, name=None: bad(x))
    with ap.simulate(2):
        x = _x()
        for _ in range(2):                      # refused again: a failing plan is never stored
            with pytest.raises(err, match=match) as e:
                paddle.nn.functional.relu(x)
            assert "spmd rule 'relu'" in str(e.value)


def test_the_correct_rule_passes_the_same_check(override_relu):
    """Control: the built-in rule, through the same first-call check."""
    with ap.simulate(2):
        x = _x()
        np.testing.assert_array_equal(paddle.nn.functional.relu(x).numpy(), np.maximum(x.numpy(), 0))


def test_a_rule_that_raises_is_named_with_the_op_and_input_specs(override_relu):
    def broken(x, name=None):
        return {}["missing"]

    register_spmd_rule("relu", broken)
    with ap.simulate(2):
        with pytest.raises(KeyError, match=r"spmd rule 'relu' failed on inputs \(float32\[4, 3\]\[S\(0\)\]\)"):
            paddle.nn.functional.relu(_x())


def test_custom_op_rejects_a_non_string_name_and_a_non_callable():
    with pytest.raises(TypeError, match="non-empty str"):
        ap.custom_op(42)
    with pytest.raises(TypeError, match="non-empty str"):
        ap.custom_op(lambda x: x)
    with pytest.raises(TypeError, match="decorates a function"):
        ap.custom_op("my_op")(3)


def test_a_value_dependent_shape_cannot_be_traced():
    class Route(paddle.nn.Layer):
        def forward(self, x):
            return paddle.nonzero(x > 0)

    mesh = mesh_from_shape([2], ["x"])
    with pytest.raises(DataDependentShapeError, match="nonzero: its output size depends on the values"):
        ap.trace(Route(), ap.DistSpec(mesh, (S(0),), (4, 3), "float32"))


def test_python_control_flow_on_a_value_cannot_be_traced():
    class Branch(paddle.nn.Layer):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    mesh = mesh_from_shape([2], ["x"])
    with pytest.raises(NotImplementedError, match="cannot be traced"):
        ap.trace(Branch(), ap.DistSpec(mesh, (S(0),), (4, 3), "float32"))
