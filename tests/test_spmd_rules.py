"""spmd_rules: registry, SpmdResult, einsum notation, matmul family, elementwise (pure, no paddle)."""
import subprocess
import sys

import pytest


from autoparallel.placement import Partial, Replicate


import spmd_rules
from spmd_rules import (NoSpmdRuleError, SpmdResult, flatten_specs, get_spmd_rule, has_spmd_rule,
                        register_spmd_rule, registered_ops)
from spmd_rules.einsum import parse_equation

from spmd_helpers import M1, M2, M3, S, rule  # noqa: F401


# ---- package hygiene --------------------------------------------------------------------------------------------------
def test_import_is_pure():
    code = "import sys, spmd_rules; assert 'paddle' not in sys.modules, 'spmd_rules imported paddle'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_names():
    for n in ("register_spmd_rule", "get_spmd_rule", "has_spmd_rule", "registered_ops", "SpmdResult"):
        assert hasattr(spmd_rules, n)
    assert {"matmul", "linear", "add", "reshape", "getitem", "cross_entropy"} <= set(registered_ops())


# ---- matmul family ----------------------------------------------------------------------------------------------------
def test_matmul_strings_1d():
    mm = rule("matmul")
    assert str(mm(S([4, 6], "S(0)"), S([6, 8]))) == "(S(0), R) -> S(0)"
    assert str(mm(S([4, 6], "S(1)"), S([6, 8]))) == "(S(1), S(0)) -> P(sum)"
    assert str(mm(S([4, 6]), S([6, 8], "S(1)"))) == "(R, S(1)) -> S(1)"
    assert str(mm(S([4, 6], "P"), S([6, 8]))) == "(P(sum), R) -> P(sum)"
    assert str(mm(S([4, 6]), S([6, 8]))) == "(R, R) -> R"


def test_matmul_nd_string_and_shapes():
    res = rule("matmul")(S([4, 6], "S(0), R", M2), S([6, 8], "R, S(1)", M2))
    assert str(res) == "([S(0), R], [R, S(1)]) -> [S(0), S(1)]"
    assert res.output.shape == (4, 8) and res.output.dtype == "float32"
    assert res.split_mesh_dims() == (0, 1)


def test_matmul_contracted_shard_is_partial():
    res = rule("matmul")(S([3, 4, 6], "S(2)"), S([6, 8], "S(0)"))
    assert res.output.placements == (Partial("sum"),)
    assert res.output.shape == (3, 4, 8)


def test_matmul_conflict_keeps_larger_operand():
    # x (4x6=24 elements) shards rows, y (6x8=48) shards columns: y wins, x is gathered
    res = rule("matmul")(S([4, 6], "S(0)"), S([6, 8], "S(1)"))
    assert str(res) == "(R, S(1)) -> S(1)"
    # equal sizes: the first operand wins
    res = rule("matmul")(S([6, 6], "S(0)"), S([6, 6], "S(1)"))
    assert str(res) == "(S(0), R) -> S(0)"


def test_matmul_transpose_and_broadcast():
    res = rule("matmul")(S([2, 3, 4], "S(2)"), S([5, 4], "R"), transpose_y=True)
    assert res.output.shape == (2, 3, 5)
    assert str(res) == "(S(2), S(1)) -> P(sum)"
    res = rule("matmul")(S([3, 1, 5, 4], "S(0)"), S([2, 4, 6], "S(0)"))
    assert res.output.shape == (3, 2, 5, 6)
    assert str(res) == "(S(0), R) -> S(0)"
    # y's batch dim 0 is out dim 1; x's broadcast dim 1 cannot be sharded
    res = rule("matmul")(S([3, 1, 5, 4], "S(1)"), S([2, 4, 6], "S(0)"))
    assert str(res) == "(R, S(0)) -> S(1)"


def test_matmul_vector():
    assert rule("matmul")(S([6]), S([6, 5])).output.shape == (5,)
    assert str(rule("matmul")(S([6], "S(0)"), S([6], "S(0)"))) == "(S(0), S(0)) -> P(sum)"


def test_matmul_shape_error_names_both_shapes():
    with pytest.raises(ValueError, match=r"\[4, 6\].*\[5, 8\]"):
        rule("matmul")(S([4, 6]), S([5, 8]))


def test_linear_bias_follows_output():
    lin = rule("linear")
    assert str(lin(S([4, 6], "S(1)"), S([6, 8], "S(0)"), S([8]))) == "(S(1), S(0), P(sum)) -> P(sum)"
    assert str(lin(S([4, 6]), S([6, 8], "S(1)"), S([8]))) == "(R, S(1), S(0)) -> S(1)"
    assert str(lin(S([4, 6], "S(0)"), S([6, 8]), S([8], "S(0)"))) == "(S(0), R, R) -> S(0)"
    with pytest.raises(ValueError, match="in_features"):
        lin(S([4, 5]), S([6, 8]))


def test_linear_keyword_order_follows_the_call():
    res = rule("linear")(S([4, 6]), bias=S([8]), weight=S([6, 8], "S(1)"))
    assert [str(s.placements[0]) for s in res.inputs] == ["R", "S(0)", "S(1)"]   # x, bias, weight as passed
    assert [s.shape for s in res.inputs] == [(4, 6), (8,), (6, 8)]
    res = rule("linear")(S([4, 6]), weight=S([6, 8], "S(1)"), bias=S([8]))      # same call, other order
    assert [s.shape for s in res.inputs] == [(4, 6), (6, 8), (8,)]


def test_bmm_and_einsum():
    assert str(rule("bmm")(S([2, 4, 6], "S(0)"), S([2, 6, 3]))) == "(S(0), S(0)) -> S(0)"
    with pytest.raises(ValueError, match="bmm"):
        rule("bmm")(S([2, 4, 6]), S([3, 6, 3]))
    res = rule("einsum")("bshd,bthd->bhst", S([2, 5, 4, 8], "S(2)"), S([2, 7, 4, 8]))
    assert res.output.shape == (2, 4, 5, 7)
    assert str(res) == "(S(2), S(2)) -> S(1)"
    assert str(rule("einsum")("ij,jk->ik", S([4, 6], "S(1)"), S([6, 2]))) == "(S(1), S(0)) -> P(sum)"
    assert rule("einsum")("ij->j", S([4, 6], "S(0)")).output.placements == (Partial("sum"),)


def test_parse_equation():
    labels, out, shape = parse_equation("einsum", "...ij,jk->...ik", [(2, 3, 4), (4, 5)])
    assert shape == (2, 3, 5) and labels[1] == ("j", "k")
    assert parse_equation("einsum", "ij,jk", [(2, 3), (3, 4)])[1] == ("i", "k")       # implicit output
    with pytest.raises(ValueError, match="size"):
        parse_equation("einsum", "ij,jk->ik", [(2, 3), (4, 5)])
    # a label repeated inside one operand (a diagonal) is whole everywhere: None in every operand and the output
    assert parse_equation("einsum", "ii->i", [(3, 3)]) == ([(None, None)], (None,), (3,))
    assert parse_equation("einsum", "bii,bj->bij", [(2, 3, 3), (2, 5)]) == \
        ([("b", None, None), ("b", "j")], ("b", None, "j"), (2, 3, 5))
    with pytest.raises(ValueError, match="size"):
        parse_equation("einsum", "ii->i", [(3, 4)])          # a diagonal of a non-square pair of dims


def test_nested_sharding_kept_by_label_rules():
    res = rule("matmul")(S([8, 6], "S(0), S(0)", M2), S([6, 4], "R, R", M2))
    assert str(res) == "([S(0), S(0)], [R, R]) -> [S(0), S(0)]"
    res = rule("matmul")(S([8, 6], "S(1), S(1)", M2), S([6, 4], "S(0), S(0)", M2))
    assert str(res) == "([S(1), S(1)], [S(0), S(0)]) -> [P(sum), P(sum)]"


# ---- elementwise ----------------------------------------------------------------------------------------------------
def test_unary():
    assert str(rule("relu")(S([4, 6], "S(1)"))) == "(S(1)) -> S(1)"
    assert str(rule("exp")(S([4, 6], "P"))) == "(R) -> R"                 # nonlinear: reduce first
    assert str(rule("neg")(S([4, 6], "P"))) == "(P(sum)) -> P(sum)"       # linear: passes
    assert str(rule("scale")(S([4], "P"), scale=2.0)) == "(P(sum)) -> P(sum)"
    assert str(rule("scale")(S([4], "P"), scale=2.0, bias=1.0)) == "(R) -> R"
    assert rule("exp")(S([4], dtype="int64")).output.dtype == "float32"
    res = rule("cast")(S([4], "P"), "float64")
    assert str(res) == "(P(sum)) -> P(sum)" and res.output.dtype == "float64"
    assert str(rule("cast")(S([4], "P"), "int32")) == "(R) -> R"
    assert rule("cast")(S([4]), "paddle.bfloat16").output.dtype == "bfloat16"


def test_binary_partial_rules():
    assert str(rule("add")(S([4, 6], "P"), S([6]))) == "(R, R) -> R"          # add(P, R) is not linear
    assert str(rule("add")(S([4, 6], "P"), S([6], "P"))) == "(P(sum), P(sum)) -> P(sum)"
    assert str(rule("subtract")(S([4, 6], "P(avg)"), S([6], "P(avg)"))) == "(P(avg), P(avg)) -> P(avg)"
    assert str(rule("add")(S([4, 6], "P(max)"), S([6], "P(max)"))) == "(R, R) -> R"
    assert str(rule("multiply")(S([4, 6], "P"), S([6]))) == "(P(sum), R) -> P(sum)"
    assert str(rule("multiply")(S([4, 6], "P"), S([6], "P"))) == "(P(sum), R) -> P(sum)"   # keep the larger
    assert str(rule("divide")(S([4, 6], "P"), S([6]))) == "(P(sum), R) -> P(sum)"
    assert str(rule("divide")(S([4, 6]), S([6], "P"))) == "(R, R) -> R"
    assert str(rule("maximum")(S([4, 6], "P"), S([6]))) == "(R, R) -> R"


def test_binary_broadcast_and_scalars():
    res = rule("add")(S([4, 1, 6], "S(1)"), S([3, 6], "S(0)"))
    assert res.output.shape == (4, 3, 6)
    assert str(res) == "(R, S(0)) -> S(1)"                  # x's dim 1 broadcasts: cannot stay sharded
    assert str(rule("add")(S([4, 6], "P"), 2.0)) == "(R) -> R"
    assert str(rule("multiply")(S([4, 6], "P"), 2.0)) == "(P(sum)) -> P(sum)"
    assert str(rule("divide")(2.0, S([4, 6], "P"))) == "(R) -> R"
    assert rule("divide")(S([4], dtype="int64"), S([4], dtype="int64")).output.dtype == "float32"
    assert rule("add")(S([4], dtype="float32"), S([4], dtype="float64")).output.dtype == "float64"
    with pytest.raises(ValueError, match="broadcast"):
        rule("add")(S([4, 5]), S([4, 6]))


def test_comparisons_and_where():
    res = rule("less_than")(S([4, 6], "S(0)"), S([6]))
    assert res.output.dtype == "bool" and str(res) == "(S(0), R) -> S(0)"
    res = rule("where")(S([4, 6], "S(1)", dtype="bool"), S([4, 6]), 0.0)
    assert str(res) == "(S(1), S(1)) -> S(1)"
    res = rule("where")(S([4], "S(0)", dtype="bool"))       # one argument: nonzero, a value-dependent size
    assert str(res.inputs[0].placements[0]) == "R" and res.outputs[0].__class__.__name__ == "LocalShaped"


def test_reverse_forms():
    res = rule("matmul").reverse([S([4, 8], "P")], S([4, 6]), S([6, 8]))
    assert [str(s.placements[0]) for s in res.inputs] == ["S(1)", "S(0)"]
    res = rule("matmul").reverse([S([4, 8], "S(1)")], S([4, 6]), S([6, 8]))
    assert [str(s.placements[0]) for s in res.inputs] == ["R", "S(1)"]
    res = rule("add").reverse([S([4, 6], "S(1)")], S([4, 6]), S([6]))
    assert [str(s.placements[0]) for s in res.inputs] == ["S(1)", "S(0)"]
    assert rule("linear").has_reverse and not rule("getitem").has_reverse
    with pytest.raises(NotImplementedError, match="register_spmd_rule"):
        rule("getitem").reverse([S([4])], S([4, 6]), 0)


# ---- registry ----------------------------------------------------------------------------------------------------------
def test_unknown_op_error_names_register_spmd_rule():
    with pytest.raises(NotImplementedError, match="register_spmd_rule"):
        get_spmd_rule("no_such_op")
    with pytest.raises(KeyError):
        get_spmd_rule("no_such_op")
    assert isinstance(NoSpmdRuleError("x"), NotImplementedError) and not has_spmd_rule("no_such_op")


def test_user_rule_decorator_and_replacement(scratch_rule):
    scratch_rule.append("my_fused_swiglu")

    @register_spmd_rule("my_fused_swiglu")
    def swiglu(x, y):
        return spmd_rules.elementwise_result("my_fused_swiglu", [x, y])

    assert callable(swiglu) and has_spmd_rule("my_fused_swiglu")
    assert str(get_spmd_rule("my_fused_swiglu")(S([4, 6], "S(1)"), S([4, 6]))) == "(S(1), S(1)) -> S(1)"

    @register_spmd_rule(["my_fused_swiglu"])          # re-registering replaces
    def swiglu_replicated(x, y):
        return SpmdResult([["R"], ["R"]], [x.with_placements([Replicate()])])

    assert str(get_spmd_rule("my_fused_swiglu")(S([4, 6], "S(1)"), S([4, 6]))) == "(R, R) -> R"


def test_user_rule_wrong_arity(scratch_rule):
    scratch_rule.append("bad_arity")
    register_spmd_rule("bad_arity", lambda x, y: SpmdResult([x], [x]))
    with pytest.raises(TypeError, match=r"'bad_arity'.*1 required input specs, expected 2"):
        get_spmd_rule("bad_arity")(S([4]), S([4]))


def test_user_rule_invalid_placements(scratch_rule):
    scratch_rule.extend(["bad_placement", "bad_output", "bad_shape", "bad_return"])
    register_spmd_rule("bad_placement", lambda x: SpmdResult([["S(3)"]], [x]))
    with pytest.raises(ValueError, match=r"'bad_placement'.*S\(3\)"):
        get_spmd_rule("bad_placement")(S([4, 6]))
    register_spmd_rule("bad_output", lambda x: SpmdResult([x], ["S(0)"]))
    with pytest.raises(TypeError, match=r"'bad_output'.*output 0 must be a DistSpec"):
        get_spmd_rule("bad_output")(S([4, 6]))
    register_spmd_rule("bad_shape", lambda x: SpmdResult([S([5, 6])], [x]))
    with pytest.raises(ValueError, match=r"'bad_shape'.*only change placements"):
        get_spmd_rule("bad_shape")(S([4, 6]))
    register_spmd_rule("bad_return", lambda x: (x, x))
    with pytest.raises(TypeError, match=r"'bad_return' must return an SpmdResult"):
        get_spmd_rule("bad_return")(S([4, 6]))


def test_rule_errors_name_the_op(scratch_rule):
    scratch_rule.append("picky")

    def picky(x):
        raise ValueError("needs a square matrix")

    register_spmd_rule("picky", picky)
    with pytest.raises(ValueError, match="picky: needs a square matrix"):
        get_spmd_rule("picky")(S([4, 6]))
    with pytest.raises(TypeError, match="unexpected keyword"):
        get_spmd_rule("relu")(S([4]), foo=1)


def test_register_validates_its_arguments():
    with pytest.raises(TypeError):
        register_spmd_rule(3)
    with pytest.raises(TypeError):
        register_spmd_rule("x", 5)


def test_flatten_specs_order_and_cache():
    a, b, c = S([2]), S([3]), S([4])
    assert flatten_specs(([a, b], 1), {"z": c}) == [a, b, c]
    r1 = rule("concat")([S([4, 2], "S(0)"), S([4, 3])], axis=1)
    r2 = rule("concat")([S([4, 2], "S(0)"), S([4, 3])], axis=1)
    assert r1 is r2 and str(r1) == "(S(0), S(0)) -> S(0)"


def test_result_repr_and_local_call():
    res = rule("reshape")(S([6, 4], "S(0)", M3), [24])
    assert "reshape" in repr(res) and "[6, 4] float32 [S(0)]" in repr(res)
    args, kwargs = rule("reshape").local_call(res, ("local_x", [24]), {}, (2,))
    assert args == ("local_x", [8]) and kwargs == {}
    args, kwargs = rule("reshape").local_call(res, ("local_x",), {"shape": [24]}, (1,))
    assert kwargs == {"shape": [8]}
