"""spmd_rules: reductions, softmax, norms, embedding, loss, attention, conv, creation, randomness, optimizer,
n-d expansion (pure)."""
import pytest


from autoparallel.placement import Replicate, Shard


from spmd_rules import MeshDim, SpmdResult, expand

from spmd_helpers import M1, M2, M3, S, rule  # noqa: F401


# ---- reductions ----------------------------------------------------------------------------------------------------
def test_sum_mean_partial():
    res = rule("sum")(S([5, 6, 7], "S(1)"), axis=1)
    assert str(res) == "(S(1)) -> P(sum)" and res.output.shape == (5, 7)
    assert str(rule("sum")(S([5, 6, 7], "S(2)"), axis=1)) == "(S(2)) -> S(1)"
    assert str(rule("sum")(S([5, 6], "P"), axis=0)) == "(P(sum)) -> P(sum)"
    assert rule("sum")(S([5, 6], "S(0)")).output.shape == ()
    assert rule("sum")(S([5, 6], dtype="bool")).output.dtype == "int64"
    res = rule("mean")(S([5, 6, 7], "S(1)"), axis=[0, 1], keepdim=True)
    assert str(res) == "(S(1)) -> P(sum) via global_mean" and res.output.shape == (1, 1, 7)
    assert res.local_kwargs((1,)) == {"global_count": 30}
    assert rule("mean")(S([5, 6], "S(1)"), axis=0).local_op is None
    assert str(rule("mean")(S([5, 6], "P(avg)"), axis=0)) == "(P(avg)) -> P(avg)"


def test_max_min_argmax():
    assert str(rule("max")(S([5, 6], "S(1)"), axis=1)) == "(S(1)) -> P(max)"
    assert str(rule("min")(S([5, 6], "S(1)"), axis=-1, keepdim=True)) == "(S(1)) -> P(min)"
    assert str(rule("max")(S([5, 6], "P"), axis=1)) == "(R) -> R"
    assert str(rule("max")(S([5, 2], "S(1)", M3), axis=1)) == "(R) -> R"        # 2 over 3 leaves a rank empty
    res = rule("argmax")(S([5, 6], "S(1)"), axis=1)
    assert str(res) == "(R) -> R" and res.output.dtype == "int64"
    assert str(rule("argmax")(S([5, 6], "S(0)"), axis=1)) == "(S(0)) -> S(0)"
    assert rule("argmax")(S([5, 6, 7]), keepdim=True).output.shape == (1, 1, 1)


def test_softmax_axis_must_be_whole():
    assert str(rule("softmax")(S([5, 6], "S(1)"))) == "(R) -> R"
    assert str(rule("softmax")(S([5, 6], "S(0)"))) == "(S(0)) -> S(0)"
    assert str(rule("log_softmax")(S([5, 6], "S(1)"), axis=0)) == "(S(1)) -> S(1)"
    assert str(rule("softmax")(S([5, 6], "P"))) == "(R) -> R"


# ---- norms ------------------------------------------------------------------------------------------------------------
def test_layer_norm():
    ln = rule("layer_norm")
    assert str(ln(S([2, 5, 6], "S(1)"), 6, S([6]), S([6]))) == "(S(1), R, R) -> S(1)"
    assert str(ln(S([2, 5, 6], "S(2)"), [6], S([6], "S(0)"), S([6]))) == "(R, R, R) -> R"
    assert str(ln(S([2, 5, 6], "S(0)"), [5, 6])) == "(S(0)) -> S(0)"
    with pytest.raises(ValueError, match="normalized_shape"):
        ln(S([2, 5, 6]), [5])


def test_rms_norm_outputs():
    res = rule("rms_norm")(S([6, 5, 8], "S(0)"), [8], S([8]))
    assert str(res) == "(S(0), R) -> (S(0), S(0))"
    assert res.outputs[1].shape == (30,) and res.outputs[1].dtype == "float32"
    assert str(rule("rms_norm")(S([6, 5, 8], "S(1)"), [8])) == "(R) -> (R, R)"   # rows of invvar interleave


def test_batch_norm():
    bn = rule("batch_norm")
    x, st = S([4, 6, 3, 3], "S(0)"), S([6])
    assert str(bn(x, st, st, S([6]), S([6]))) == "(S(0), R, R, R, R) -> S(0)"
    res = bn(x, st, st, S([6]), S([6]), training=True)
    assert str(res) == "(S(0), R, R, R, R) -> S(0) via sync_batch_norm"
    assert res.local_kwargs((0,)) == {"stat_mesh_dims": (0,)}
    res = bn(S([4, 6, 3, 3], "S(1)"), S([6], "S(0)"), S([6], "S(0)"), None, None, training=True)
    assert str(res) == "(S(1), S(0), S(0)) -> S(1)"                          # channels are independent
    res = bn(S([4, 6, 3, 3], "S(1)"), st, st, None, None, training=True)
    assert str(res) == "(R, R, R) -> R"            # replicated stats updated in place: x's channels gathered
    assert str(bn(S([4, 6, 3, 3], "S(1)"), st, st)) == "(S(1), S(0), S(0)) -> S(1)"     # eval: stats only read
    with pytest.raises(ValueError, match="running_mean"):
        bn(S([4, 6, 3, 3]), S([5]), st)


def test_conv2d():
    cv = rule("conv2d")
    x, w, b = S([4, 6, 5, 5]), S([8, 6, 3, 3]), S([8])
    res = cv(x.with_placements([Shard(0)]), w, b, padding=1)
    assert str(res) == "(S(0), R, R) -> S(0)" and res.output.shape == (4, 8, 5, 5)
    assert str(cv(x, w.with_placements([Shard(0)]), b)) == "(R, S(0), S(0)) -> S(1)"
    assert str(cv(x.with_placements([Shard(1)]), w, b)) == "(S(1), S(1), P(sum)) -> P(sum)"
    assert str(cv(x.with_placements([Shard(2)]), w, b)) == "(R, R, R) -> R"
    assert cv(S([4, 5, 5, 6]), S([8, 6, 2, 2]), stride=2, data_format="NHWC").output.shape == (4, 2, 2, 8)
    with pytest.raises(ValueError, match="input channels"):
        cv(S([4, 5, 5, 5]), w)


# ---- embedding / loss / attention ------------------------------------------------------------------------------------
def test_embedding_layouts():
    emb = rule("embedding")
    ids = S([4, 5], dtype="int64")
    assert str(emb(ids.with_placements([Shard(0)]), S([11, 6]))) == "(S(0), R) -> S(0)"
    assert str(emb(ids, S([11, 6], "S(1)"))) == "(R, S(1)) -> S(2)"
    assert str(emb(ids, S([11, 6], "P"))) == "(R, P(sum)) -> P(sum)"
    res = emb(S([4, 5], mesh=M3, dtype="int64"), S([11, 6], "S(0)", M3), padding_idx=9)
    assert str(res) == "(R, S(0)) -> P(sum) via vocab_parallel_embedding"
    assert res.output.shape == (4, 5, 6)
    assert res.local_kwargs((0,)) == {"vocab_start": 0, "vocab_end": 4, "padding_idx": None,
                                      "vocab_size": 11}
    assert res.local_kwargs((2,)) == {"vocab_start": 8, "vocab_end": 11, "padding_idx": 1,
                                      "vocab_size": 11}
    with pytest.raises(TypeError, match="integer ids"):
        emb(S([4]), S([11, 6]))


def test_vocab_parallel_embedding_2d_mesh():
    res = rule("embedding")(S([4, 5], "S(0), R", M2, "int64"), S([11, 6], "R, S(0)", M2))
    assert str(res) == "([S(0), R], [R, S(0)]) -> [S(0), P(sum)] via vocab_parallel_embedding"
    assert res.local_kwargs((1, 1))["vocab_start"] == 6


def test_one_hot():
    res = rule("one_hot")(S([4, 5], "S(1)", dtype="int64"), num_classes=7)
    assert str(res) == "(S(1)) -> S(1)" and res.output.shape == (4, 5, 7) and res.output.dtype == "float32"


def test_cross_entropy_layouts():
    ce = rule("cross_entropy")
    logits, lab = S([6, 10]), S([6], dtype="int64")
    res = ce(logits.with_placements([Shard(0)]), lab, reduction="none")
    assert str(res) == "(S(0), S(0)) -> S(0)" and res.output.shape == (6,)
    assert str(ce(logits.with_placements([Shard(0)]), lab, reduction="sum")) == "(S(0), S(0)) -> P(sum)"
    res = ce(logits.with_placements([Shard(0)]), lab)
    assert str(res) == "(S(0), S(0)) -> P(sum) via global_mean_cross_entropy"
    assert res.output.shape == ()
    res = ce(logits.with_placements([Shard(1)]), lab)
    assert str(res) == "(S(1), R) -> R via vocab_parallel_cross_entropy"
    assert res.local_kwargs((1,)) == {"class_start": 5, "class_end": 10, "class_count": 10,
                                      "class_mesh_dims": (0,), "batch_mesh_dims": ()}
    assert ce(S([6, 10]), S([6, 1], dtype="int64"), reduction="none").output.shape == (6, 1)
    res = ce(S([6, 10], "S(1)"), S([6, 10], "S(1)"), soft_label=True, reduction="none")
    assert str(res) == "(S(1), S(1)) -> R via vocab_parallel_cross_entropy"
    assert res.output.shape == (6, 1)
    with pytest.raises(ValueError, match="label shape"):
        ce(S([6, 10]), S([5], dtype="int64"))


def test_cross_entropy_dp_tp_mesh():
    res = rule("cross_entropy")(S([4, 6, 10], "S(0), S(2)", M2), S([4, 6], "S(0), R", M2, "int64"))
    assert str(res) == "([S(0), S(2)], [S(0), R]) -> [P(sum), R] via vocab_parallel_cross_entropy"
    assert res.local_kwargs((0, 1))["batch_mesh_dims"] == (0,)


def test_attention():
    sdpa = rule("scaled_dot_product_attention")
    q, kv = S([2, 5, 4, 8], "S(2)"), S([2, 7, 4, 8], "S(2)")
    assert str(sdpa(q, kv, kv)) == "(S(2), S(2), S(2)) -> S(2)"
    assert str(sdpa(S([2, 5, 4, 8], "S(1)"), S([2, 7, 4, 8]), S([2, 7, 4, 8]))) == "(S(1), R, R) -> S(1)"
    assert str(sdpa(S([2, 5, 4, 8], "S(1)"), S([2, 7, 4, 8]), S([2, 7, 4, 8]), is_causal=True)) == "(R, R, R) -> R"
    assert str(sdpa(S([2, 5, 4, 8]), S([2, 7, 4, 8], "S(1)"), S([2, 7, 4, 8]))) == "(R, R, R) -> R"
    assert str(sdpa(S([2, 5, 4, 8]), S([2, 7, 4, 8]), S([2, 7, 4, 8], "P"))) == "(R, R, P(sum)) -> P(sum)"
    # grouped-query attention: 8 query heads over 2 kv heads shard over 2 ranks, not over 3
    gq, gkv = S([2, 5, 8, 4], "S(2)"), S([2, 5, 2, 4])
    assert str(sdpa(gq, gkv, gkv)) == "(S(2), S(2), S(2)) -> S(2)"
    gkv3 = S([2, 5, 2, 4], mesh=M3)
    assert str(sdpa(S([2, 5, 8, 4], "S(2)", M3), gkv3, gkv3)) == "(R, R, R) -> R"
    res = sdpa(q, kv, kv, S([2, 1, 5, 7], "S(0)"))
    assert str(res) == "(S(2), S(2), S(2), R) -> S(2)"
    res = sdpa(q, kv, kv, dropout_p=0.1)
    assert res.local_op == "sharded_attention_dropout"
    assert res.local_kwargs((1,))["local_slices"] == [[0, 2], [2, 4], [0, 5], [0, 7]]


def test_flash_attention_outputs():
    fa = rule("flash_attention")
    q = S([2, 5, 4, 8], "S(0)")
    res = fa(q, q, q)
    assert len(res.outputs) == 2 and res.outputs[1] is None and str(res) == "(S(0), S(0), S(0)) -> (S(0), None)"
    res = fa(q, q, q, return_softmax=True)
    assert res.outputs[1].shape == (2, 4, 5, 5)


def test_rotary_embedding():
    rot = rule("rotary_embedding")
    res = rot(S([2, 5, 4, 8], "S(2)"), S([5, 1, 8]), S([5, 1, 8]))
    assert str(res) == "(S(2), R, R) -> S(2)"
    assert str(rot(S([2, 5, 4, 8], "S(1)"), S([5, 1, 8]), S([5, 1, 8]))) == "(S(1), S(0), S(0)) -> S(1)"
    assert str(rot(S([2, 5, 4, 8], "S(3)"), S([5, 1, 8]), S([5, 1, 8]))) == "(R, R, R) -> R"
    assert str(rot(S([2, 5, 4, 8], "P"), S([5, 1, 8]), S([5, 1, 8]))) == "(P(sum), R, R) -> P(sum)"


# ---- creation / randomness / optimizer ----------------------------------------------------------------------------------
def test_like_ops():
    res = rule("zeros_like")(S([5, 6], "P"))
    assert str(res) == "(P(sum)) -> R"
    assert rule("full_like")(S([5, 6], "S(1)"), 2.0, dtype="int32").output.dtype == "int32"


def test_arange_full_local_attrs():
    res = rule("arange")(0, 7, mesh=M3, placements=[Shard(0)])
    assert res.inputs == () and str(res) == "() -> S(0)" and res.output.dtype == "int64"
    assert [res.local_kwargs((c,)) for c in range(3)] == [{"start": 0, "end": 3, "step": 1},
                                                          {"start": 3, "end": 6, "step": 1},
                                                          {"start": 6, "end": 7, "step": 1}]
    assert rule("arange")(5, mesh=M1).output.shape == (5,)
    res = rule("arange")(0.0, 2.5, 0.5, mesh=M1, placements=["S(0)"])
    assert res.output.dtype == "float32" and res.output.shape == (5,)
    assert res.local_kwargs((1,))["start"] == 1.5
    res = rule("full")([5, 6], 1.5, mesh=M2, placements=["S(1)", "S(0)"])
    assert res.local_kwargs((1, 0)) == {"shape": [3, 3]}
    assert str(rule("zeros")([4], mesh=M1)) == "() -> R"
    with pytest.raises(TypeError, match="mesh="):
        rule("ones")([4])
    with pytest.raises(ValueError, match="Partial"):
        rule("ones")([4], mesh=M1, placements=["P"])


def test_randomness():
    res = rule("dropout")(S([5, 6], "S(0)"), p=0.5)
    assert str(res) == "(S(0)) -> S(0) via sharded_dropout"
    assert res.local_kwargs((1,)) == {"global_shape": [5, 6], "local_slices": [[3, 5], [0, 6]]}
    assert str(rule("dropout")(S([5, 6], "P"), p=0.5)) == "(R) -> R via sharded_dropout"
    assert str(rule("dropout")(S([5, 6], "P"), p=0.5, training=False)) == "(P(sum)) -> P(sum)"
    res = rule("randn")([5, 6], mesh=M1, placements=["S(1)"])
    assert res.local_op == "sharded_random" and res.local_kwargs((1,))["local_slices"] == [[0, 5], [3, 6]]
    assert rule("randint")(0, 9, [4], mesh=M1).output.dtype == "int64"


def test_optimizer_updates_follow_the_parameter():
    p, g = S([5, 6], "S(0)"), S([5, 6], "P")
    lr = S([1])
    res = rule("sgd")(p, lr, g)
    assert str(res) == "(S(0), R, S(0)) -> (S(0), None)"
    res = rule("adamw")(p, g, lr, S([5, 6]), S([5, 6]), None, S([1]), S([1]), None, None)
    assert str(res) == "(S(0), S(0), R, S(0), S(0), R, R) -> (S(0), S(0), S(0), None, R, R, None)"
    res = rule("adamw")(S([5, 6], "P"), g, lr, S([5, 6]), S([5, 6]), None, S([1]), S([1]), None, None)
    assert res.inputs[0].placements == (Replicate(),)
    with pytest.raises(ValueError, match="moment1"):
        rule("adamw")(p, g, lr, S([6, 5]), S([5, 6]), None, S([1]), S([1]), None, None)


# ---- n-d expansion --------------------------------------------------------------------------------------------------------
def test_expand_runs_a_one_dim_rule_per_mesh_dim():
    seen = []

    def rule_1d(pl, dim):
        seen.append((pl, dim))
        return (pl[0],), (pl[0],)

    x = S([8, 6], "S(0), S(1)", M2)
    req, outs = expand("demo", [x], [((8, 6), "float32")], rule_1d)
    assert [d for _, d in seen] == [MeshDim(0, 2), MeshDim(1, 2)]
    assert req[0] == x and outs[0].placements == (Shard(0), Shard(1))


def test_expand_unnests_for_rules_that_do_not_declare_nesting():
    seen = []

    def rule_1d(pl, dim):
        seen.append(pl[0])
        return (pl[0],), (pl[0],)

    x = S([8, 6], "S(0), S(0)", M2)
    req, outs = expand("demo", [x], [((8, 6), "float32")], rule_1d)
    assert seen == [Shard(0), Replicate()]              # the inner mesh dim is shown as R
    assert req[0].placements == (Shard(0), Replicate())
    req, outs = expand("demo", [x], [((8, 6), "float32")], lambda pl, dim: (pl, pl), nested=True)
    assert req[0] == x


def test_expand_validates_one_dim_rules():
    with pytest.raises(TypeError, match="expected 1 and 1"):
        expand("demo", [S([4])], [((4,), "float32")], lambda pl, dim: ((), ()))
    with pytest.raises(ValueError, match="one mesh"):
        expand("demo", [S([4]), S([4], mesh=M3)], [((4,), "float32")], lambda pl, dim: (pl, pl[:1]))


def test_result_str_with_several_outputs_and_no_inputs():
    assert str(SpmdResult((), (S([4], "S(0)"), None))) == "() -> (S(0), None)"


def test_reverse_reductions_and_norms():
    res = rule("sum").reverse([S([5, 7], "P")], S([5, 6, 7]), axis=1)
    assert res.inputs[0].placements == (Shard(1),)
    res = rule("sum").reverse([S([5, 7], "S(1)")], S([5, 6, 7]), axis=1)
    assert res.inputs[0].placements == (Shard(2),)
    res = rule("max").reverse([S([5], "P(max)")], S([5, 6]), axis=1)
    assert res.inputs[0].placements == (Shard(1),)
    res = rule("softmax").reverse([S([5, 6], "S(1)")], S([5, 6]))
    assert res.inputs[0].placements == (Replicate(),)
    res = rule("layer_norm").reverse([S([2, 5, 6], "S(0)")], S([2, 5, 6]), [6], S([6]), S([6]))
    assert [s.placements[0] for s in res.inputs] == [Shard(0), Replicate(), Replicate()]
