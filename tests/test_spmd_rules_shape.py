"""spmd_rules: reshape via dim transformations, layout ops, split/concat, getitem, tril (pure)."""
import pytest


from autoparallel.placement import Partial, Replicate, Shard



from spmd_rules.dimtrans import Flatten, InputDim, Singleton, Split, infer_shape, reshape_transforms, shard_map
from spmd_rules.result import LocalShaped

from spmd_helpers import M1, M2, M3, S, rule  # noqa: F401


# ---- dim transformations ------------------------------------------------------------------------------------------
def test_reshape_transforms():
    assert reshape_transforms([6, 4], [24]) == [Flatten((InputDim(0), InputDim(1)))]
    assert reshape_transforms([24], [6, 4]) == [Split(InputDim(0), (6, 4), 0), Split(InputDim(0), (6, 4), 1)]
    assert reshape_transforms([2, 3, 5], [6, 1, 5]) == [Flatten((InputDim(0), InputDim(1))), Singleton(), InputDim(2)]
    assert reshape_transforms([1, 6], [6]) == [InputDim(1)]
    t = reshape_transforms([6, 5, 4], [6, 4, 5])
    assert t[0] == InputDim(0)
    assert t[1] == Split(Flatten((InputDim(1), InputDim(2))), (4, 5), 0)
    assert str(t[1]) == "Split(Flatten(InputDim(1), InputDim(2)), [4, 5], 0)"


def test_infer_shape():
    assert infer_shape("reshape", (6, 4), [2, -1, 4]) == (2, 3, 4)
    assert infer_shape("reshape", (6, 4), [0, 2, 2]) == (6, 2, 2)
    with pytest.raises(ValueError, match="cannot reshape"):
        infer_shape("reshape", (6, 4), [5, -1])
    with pytest.raises(ValueError, match="at most one -1"):
        infer_shape("reshape", (6, 4), [-1, -1])


def test_shard_map_alignment():
    # 24 -> [6, 4]: chunks line up over 2 and 3 ranks; 20 -> [5, 4] over 3 does not (7,7,6 vs 8,8,4)
    assert shard_map((24,), (6, 4), reshape_transforms([24], [6, 4]), 3) == {0: 0}
    assert shard_map((20,), (5, 4), reshape_transforms([20], [5, 4]), 3) == {}
    assert shard_map((20,), (5, 4), reshape_transforms([20], [5, 4]), 2) == {}    # 10,10 vs 12,8
    assert shard_map((6, 4), (24,), reshape_transforms([6, 4], [24]), 2) == {0: 0}


# ---- reshape family ----------------------------------------------------------------------------------------------------
def test_reshape_rules():
    r = rule("reshape")
    res = r(S([6, 5, 4], "S(0)"), [6, 20])
    assert str(res) == "(S(0)) -> S(0)" and res.output.shape == (6, 20)
    assert str(r(S([6, 4, 5], "S(1)"), [6, 20])) == "(S(1)) -> S(1)"      # 4 over 2: 2,2 rows = 10,10 elements
    assert str(r(S([6, 5, 4], "S(1)"), [6, 20])) == "(R) -> R"            # 5 over 2: 3,2 rows = 12,8 != 10,10
    assert str(r(S([6, 5, 4], "S(2)"), [6, 20])) == "(R) -> R"            # inner dim of a flatten
    assert str(r(S([6, 20], "S(1)"), [6, 5, 4])) == "(R) -> R"            # 20 -> [5, 4] over 2 misaligned
    assert str(r(S([24, 5], "S(0)", M3), shape=[6, -1, 5])) == "(S(0)) -> S(0)"
    assert str(r(S([6, 4], "P"), [24])) == "(P(sum)) -> P(sum)"


def test_reshape_local_shape_attrs():
    res = rule("reshape")(S([6, 5, 4], "S(0)", M3), [6, 20])
    assert res.local_kwargs((0,)) == {"shape": [2, 20]}
    res = rule("reshape")(S([5, 4], "S(0)", M3), [5, 2, 2])
    assert [res.local_kwargs((c,))["shape"] for c in range(3)] == [[2, 2, 2], [2, 2, 2], [1, 2, 2]]
    assert rule("reshape")(S([6, 4]), [24]).local_attrs is None


def test_reshape_nested_input_is_unnested():
    res = rule("reshape")(S([8, 4], "S(0), S(0)", M2), [32])
    assert str(res) == "([S(0), R]) -> [S(0), R]"


def test_flatten_and_view():
    res = rule("flatten")(S([6, 4, 5], "S(1)"), start_axis=1)
    assert res.output.shape == (6, 20) and str(res) == "(S(1)) -> S(1)"
    assert res.local_attrs is None                            # the local flatten gives the local shape
    assert rule("flatten")(S([6, 5, 4])).output.shape == (120,)
    res = rule("view")(S([6, 5, 4], "S(0)"), [6, 20])
    assert res.local_kwargs((1,)) == {"shape_or_dtype": [3, 20]}
    assert rule("view")(S([6, 4], "S(0)"), "int32").output.dtype == "int32"


def test_transpose_unsqueeze_squeeze():
    res = rule("transpose")(S([5, 6, 7], "S(0)"), [2, 0, 1])
    assert str(res) == "(S(0)) -> S(1)" and res.output.shape == (7, 5, 6)
    assert str(rule("transpose")(S([5, 6], "P"), [1, 0])) == "(P(sum)) -> P(sum)"
    assert str(rule("t")(S([5, 6], "S(1)"))) == "(S(1)) -> S(0)"
    res = rule("unsqueeze")(S([5, 6], "S(1)"), [0, 2])
    assert res.output.shape == (1, 5, 1, 6) and str(res) == "(S(1)) -> S(3)"
    res = rule("squeeze")(S([5, 1, 6], "S(2)"), axis=1)
    assert res.output.shape == (5, 6) and str(res) == "(S(2)) -> S(1)"
    assert str(rule("squeeze")(S([5, 1, 6], "S(1)"))) == "(R) -> R"


def test_expand_local_shape():
    res = rule("expand")(S([5, 1, 6], "S(0)"), [3, 5, 7, 6])
    assert str(res) == "(S(0)) -> S(1)" and res.output.shape == (3, 5, 7, 6)
    assert res.local_kwargs((1,)) == {"shape": [3, 2, 7, 6]}
    assert str(rule("broadcast_to")(S([1, 6], "S(0)"), [5, 6])) == "(R) -> R"


def test_split_concat_stack():
    res = rule("split")(S([5, 6, 7], "S(0)"), [2, -1, 3], axis=2)
    assert str(res) == "(S(0)) -> (S(0), S(0), S(0))"
    assert [o.shape for o in res.outputs] == [(5, 6, 2), (5, 6, 2), (5, 6, 3)]
    assert str(rule("split")(S([5, 6], "S(1)"), 2, axis=1)) == "(R) -> (R, R)"
    with pytest.raises(ValueError, match="equal parts"):
        rule("chunk")(S([5, 6]), 4, axis=1)
    res = rule("concat")([S([5, 2], "S(1)"), S([5, 6], "S(0)")], axis=1)
    assert str(res) == "(S(0), S(0)) -> S(0)" and res.output.shape == (5, 8)
    assert str(rule("concat")([S([5, 2], "P"), S([5, 6], "P")], axis=1)) == "(P(sum), P(sum)) -> P(sum)"
    assert str(rule("concat")([S([5, 2], "P"), S([5, 6])], axis=1)) == "(R, R) -> R"
    res = rule("stack")([S([5, 6], "S(1)"), S([5, 6])], axis=1)
    assert str(res) == "(S(1), S(1)) -> S(2)" and res.output.shape == (5, 2, 6)


# ---- getitem --------------------------------------------------------------------------------------------------------
def test_getitem_shapes():
    g = rule("getitem")
    assert g(S([5, 6, 7]), (slice(None), 2, slice(1, 5))).output.shape == (5, 4)
    assert g(S([5, 6, 7]), (Ellipsis, None, slice(0, 7, 2))).output.shape == (5, 6, 1, 4)
    assert g(S([5, 6, 7]), 3).output.shape == (6, 7)
    assert g(S([5, 6, 7]), (slice(None), [0, 4, 1])).output.shape == (5, 3, 7)
    assert g(S([5, 6, 7]), (None,)).output.shape == (1, 5, 6, 7)
    assert g(S([5, 6, 7]), slice(None, None, -1)).output.shape == (5, 6, 7)


def test_getitem_sharding():
    g = rule("getitem")
    assert str(g(S([5, 6, 7], "S(0)"), (slice(None), 2))) == "(S(0)) -> S(0)"
    assert str(g(S([5, 6, 7], "S(2)"), (slice(None), 2))) == "(S(2)) -> S(1)"
    assert str(g(S([5, 6, 7], "S(1)"), (slice(None), 2))) == "(R) -> R"           # int on a sharded dim
    assert str(g(S([5, 6, 7], "S(2)"), (Ellipsis, slice(1, 5)))) == "(R) -> R"     # partial slice
    assert str(g(S([5, 6, 7], "S(2)"), (Ellipsis, slice(0, 100)))) == "(S(2)) -> S(2)"  # a full slice
    assert str(g(S([5, 6, 7], "S(0)"), slice(None, None, -1))) == "(R) -> R"        # reversed
    assert str(g(S([5, 6], "P"), 1)) == "(P(sum)) -> P(sum)"


def test_getitem_tensor_index():
    idx = S([4, 3], "S(0)", dtype="int64")
    res = rule("getitem")(S([5, 6, 7], "S(1)"), (slice(None), idx))
    assert res.output.shape == (5, 4, 3, 7)
    assert str(res) == "(R, S(0)) -> S(1)"
    res = rule("getitem")(S([5, 6], "S(0)"), S([5, 6], "S(1)", dtype="bool"))     # a mask: value-dependent size
    assert [str(p) for s in res.inputs for p in s.placements] == ["R", "R"]
    assert isinstance(res.outputs[0], LocalShaped)


def test_getitem_errors():
    g = rule("getitem")
    with pytest.raises(IndexError, match="too many indices"):
        g(S([5, 6]), (1, 2, 3))
    with pytest.raises(IndexError, match="out of range"):
        g(S([5, 6]), 7)
    with pytest.raises(TypeError, match="unsupported index"):
        g(S([5, 6]), "a")
    res = g(S([5, 6], "S(1)"), ([0, 1], [1, 2]))      # several advanced indices: gathered, replicated result
    assert str(res.inputs[0].placements[0]) == "R" and isinstance(res.outputs[0], LocalShaped)


def test_tril_offsets():
    res = rule("tril")(S([5, 7], "S(0)", M3))
    assert str(res) == "(S(0)) -> S(0)"
    assert [res.local_kwargs((c,))["diagonal"] for c in range(3)] == [0, 2, 4]
    res = rule("triu")(S([5, 7], "S(1), S(0)", M2), diagonal=1)
    assert res.local_kwargs((1, 1)) == {"diagonal": 1 + 3 - 4}
    assert rule("tril")(S([5, 7], "S(0)", M3)).local_kwargs((0,)) == {"diagonal": 0}


def test_reverse_reshape_transpose():
    res = rule("reshape").reverse([S([6, 20], "S(0)")], S([6, 5, 4]), [6, 20])
    assert res.inputs[0].placements == (Shard(0),)
    res = rule("reshape").reverse([S([6, 20], "S(1)")], S([6, 5, 4]), [6, 20])
    assert res.inputs[0].placements == (Replicate(),)              # 5 over 2 does not line up with 20 over 2
    res = rule("transpose").reverse([S([7, 5, 6], "S(0)")], S([5, 6, 7]), [2, 0, 1])
    assert res.inputs[0].placements == (Shard(2),)
    res = rule("flatten").reverse([S([6, 20], "P")], S([6, 4, 5]), start_axis=1)
    assert res.inputs[0].placements == (Partial("sum"),)
