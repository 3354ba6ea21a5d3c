"""Block-sharded placement ``S(d,blocks=(..))``: fused projections kept local.

Placement syntax and invariants; local shards against the full tensor; reshard transitions (values and
gradients); the rules that keep a fused output local (as strings, and against the full tensor with
tools/check_rules.py); checkpoints hold the global tensor; a wrong block order is caught (negative control).
Real models (Phi3, Qwen2-MoE) under ``parallelize``: tests/test_paddleformers.py and test_comm_counts.py."""
import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.placement import BlockShard, Shard, parse_placement, parse_placements
from autoparallel.spec import DistSpec
from autoparallel.testing.check import assemble, expected_local
from reshard.planner import plan_reshard
from spmd_rules import get_spmd_rule

MESH = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
X = np.arange(4 * 12, dtype="float32").reshape(4, 12)


def spec(shape, text, mesh=MESH):
    return DistSpec(mesh, parse_placements(text), shape, "float32")


# ---- the placement -----------------------------------------------------------------------------------------
def test_syntax_round_trips_and_compares():
    p = parse_placement("S(1, blocks=[64, 32, 32])")
    assert p == BlockShard(1, (64, 32, 32)) and hash(p) == hash(BlockShard(1, [64, 32, 32]))
    assert str(p) == "S(1,blocks=(64,32,32))" and parse_placement(str(p)) == p
    assert p != Shard(1) and not p.is_shard() and p.is_block_shard(1) and not p.is_block_shard(0)
    assert parse_placements("[R, S(1,blocks=(8,4))]") == (ap.Replicate(), BlockShard(1, (8, 4)))


@pytest.mark.parametrize("shape, text, err, match", [
    ((4, 12), "R,S(1,blocks=(8,8))", ValueError, "blocks sum to 16 but tensor dim 1 has size 12"),
    ((4, 12), "R,S(1,blocks=(9,3))", ValueError, "divisible by the mesh dim size 2"),
    ((4, 12), "S(1),S(1,blocks=(8,4))", ValueError, "split by one mesh dim only"),
    ((4, 12), "R,S(2,blocks=(8,4))", ValueError, "out of range for a tensor of rank 2"),
])
def test_invariants_are_typed_errors(shape, text, err, match):
    with pytest.raises(err, match=match):
        spec(shape, text)


def test_bad_blocks_are_typed_errors():
    with pytest.raises(ValueError, match="positive sizes"):
        BlockShard(0, (4, 0))
    with pytest.raises(TypeError, match="sequence of ints"):
        BlockShard(0, "ab")


def test_local_shards_hold_a_piece_of_every_block():
    s = spec((4, 12), "S(0),S(1,blocks=(8,4))")
    assert s.local_shape(3) == (2, 6) and s.max_local_shape() == (2, 6)
    np.testing.assert_array_equal(expected_local(X, s, (1, 1)), X[2:4][:, [4, 5, 6, 7, 10, 11]])
    with ap.simulate(world_size=4):
        t = ap.shard_tensor(paddle.to_tensor(X), MESH, list(s.placements))
        np.testing.assert_array_equal(t._locals[3].numpy(), X[2:4][:, [4, 5, 6, 7, 10, 11]])
        np.testing.assert_array_equal(t.numpy(), X)
        back = ap.dtensor_from_local({r: t._locals[r] for r in range(4)}, MESH, list(s.placements))
        assert back.spec == s
        np.testing.assert_array_equal(back.numpy(), X)


# ---- reshard -------------------------------------------------------------------------------------------------
def test_planner_gathers_and_slices_blocks():
    steps = lambda a, b: [(st.collective, st.mesh_dim) for st in
                          plan_reshard((4, 12), "float32", MESH, parse_placements(a), parse_placements(b)).steps]
    assert steps("R,S(1,blocks=(8,4))", "R,R") == [("all_gather", 1)]
    assert steps("R,R", "R,S(1,blocks=(8,4))") == [("slice", 1)]
    assert steps("R,S(1,blocks=(8,4))", "R,S(1)") == [("all_gather", 1), ("slice", 1)]
    assert sorted(steps("R,P", "R,S(1,blocks=(8,4))")) == [("all_reduce", 1), ("slice", 1)]


@pytest.mark.parametrize("src, dst", [
    ("S(0),S(1,blocks=(8,4))", "R,R"), ("R,R", "R,S(1,blocks=(8,4))"), ("S(0),S(1,blocks=(8,4))", "S(1),S(0)"),
    ("R,S(1,blocks=(4,4,4))", "R,S(1,blocks=(8,4))"), ("P,R", "S(1,blocks=(6,6)),R"),
])
def test_reshard_values_and_gradients_equal_the_full_tensor(src, dst):
    """Forward: every rank holds its piece of the full tensor; backward: the gradient of sum(out * G) is G
    in the source layout (the adjoint of each step)."""
    g = np.random.default_rng(0).standard_normal(X.shape).astype("float32")
    with ap.simulate(world_size=4):
        a = ap.shard_tensor(paddle.to_tensor(X), MESH, list(parse_placements(src.replace("P", "R"))))
        if src.startswith("P"):
            a = ap.reshard(a, MESH, list(parse_placements(src)))
        a.stop_gradient = False
        b = ap.reshard(a, MESH, list(parse_placements(dst)))
        np.testing.assert_array_equal(assemble(dict(b._locals), b.spec), X)
        (b * ap.shard_tensor(paddle.to_tensor(g), MESH, list(b.placements))).sum().backward()
        np.testing.assert_allclose(a.grad.numpy(), g, rtol=1e-6)


def test_negative_control_a_wrong_block_order_is_a_different_tensor():
    with ap.simulate(world_size=4):
        t = ap.shard_tensor(paddle.to_tensor(X), MESH, list(parse_placements("R,S(1,blocks=(8,4))")))
        wrong = ap.dtensor_from_local(dict(t._locals), MESH, list(parse_placements("R,S(1,blocks=(4,8))")))
        plain = ap.dtensor_from_local(dict(t._locals), MESH, list(parse_placements("R,S(1)")))
        assert not np.array_equal(wrong.numpy(), X) and not np.array_equal(plain.numpy(), X)
        np.testing.assert_array_equal(t.numpy(), X)


# ---- rules -----------------------------------------------------------------------------------------------------
def rule(op, *args, **kwargs):
    return str(get_spmd_rule(op)(*args, **kwargs))


def test_fused_linear_chunk_and_slices_stay_local():
    x, w, b = spec((4, 8, 16), "S(0),R"), spec((16, 24), "R,S(1,blocks=(8,8,8))"), spec((24,), "R,S(0,blocks=(8,8,8))")
    assert rule("linear", x, w, b) == "([S(0), R], [R, S(1,blocks=(8,8,8))], [R, S(0,blocks=(8,8,8))]) -> " \
                                      "[S(0), S(2,blocks=(8,8,8))]"
    y = spec((4, 8, 24), "S(0),S(2,blocks=(12,12))")
    assert rule("chunk", y, 2, axis=-1) == "([S(0), S(2,blocks=(12,12))]) -> ([S(0), S(2)], [S(0), S(2)])"
    assert rule("silu", y) == "([S(0), S(2,blocks=(12,12))]) -> [S(0), S(2,blocks=(12,12))]"
    q = spec((4, 8, 24), "S(0),S(2,blocks=(12,6,6))")
    assert rule("getitem", q, (Ellipsis, slice(0, 12))) == "([S(0), S(2,blocks=(12,6,6))]) -> [S(0), S(2)]"
    assert rule("getitem", q, (Ellipsis, slice(12, None))) == \
        "([S(0), S(2,blocks=(12,6,6))]) -> [S(0), S(2,blocks=(6,6))]"
    r = get_spmd_rule("split")(q, [12, 6, 6], axis=2)
    assert str(r) == "([S(0), S(2,blocks=(12,6,6))]) -> ([S(0), S(2)], [S(0), S(2)], [S(0), S(2)])"
    assert r.local_kwargs((0, 1)) == {"num_or_sections": [6, 3, 3]}


def test_pieces_across_blocks_and_unaware_rules_gather_first():
    y = spec((4, 8, 24), "S(0),S(2,blocks=(12,12))")
    assert rule("chunk", y, 3, axis=-1) == "([S(0), R]) -> ([S(0), R], [S(0), R], [S(0), R])"
    assert rule("getitem", y, (Ellipsis, slice(6, 18))) == "([S(0), R]) -> [S(0), R]"
    assert rule("softmax", y, axis=-1) == "([S(0), R]) -> [S(0), R]"
    assert rule("multiply", y, spec((4, 8, 24), "S(0),S(2)")) == \
        "([S(0), S(2,blocks=(12,12))], [S(0), S(2,blocks=(12,12))]) -> [S(0), S(2,blocks=(12,12))]"


def test_a_block_split_meeting_a_plain_split_of_the_same_dim_gathers_the_blocks():
    """Mesh dim 0 splits dim 1 plainly, mesh dim 1 block-splits it in the other operand: no nested layout
    exists, so the block-sharded operand is gathered (the rule is retried with it replicated)."""
    x, y = spec((4, 12), "S(1),R"), spec((4, 12), "R,S(1,blocks=(6,6))")
    assert rule("multiply", x, y) == "([S(1), R], [S(1), R]) -> [S(1), R]"


def test_check_rules_full_tensor_with_block_layouts():
    """tools/check_rules.py tries S(d,blocks=..) among the layouts of its fused cases (forward and input
    gradients against the full op)."""
    import io

    from spmd_rules import validation as check_rules

    out = io.StringIO()
    assert check_rules.main(["--op", "linear", "--op", "chunk"], out=out) == 0, \
        out.getvalue()


def test_negative_control_a_rule_keeping_blocks_through_a_misaligned_chunk_is_caught():
    """A rule that calls every chunk of a block-sharded axis local (right for [gate | up] in two, wrong for a
    chunk cutting through blocks): check_rules fails it."""
    import io

    from spmd_rules.blocks import block_aware, has_blocks, unblock
    from spmd_rules.registry import _RULES, register_spmd_rule
    from spmd_rules.result import SpmdResult
    from spmd_rules import validation as check_rules

    saved = _RULES["chunk"]

    @block_aware
    def wrong(x, chunks, axis=0, name=None):
        res = saved.fn(unblock(x), chunks, axis)
        a = axis % x.ndim
        i = x.block_mesh_dim(a)
        if not has_blocks([x]) or i is None:
            return res
        return SpmdResult((x,), tuple(o.with_placements(o.placements[:i] + (Shard(a),) + o.placements[i + 1:])
                                      for o in res.outputs))

    try:
        register_spmd_rule("chunk", wrong)
        out = io.StringIO()
        assert check_rules.main(["--op", "chunk"], out=out) != 0
        assert "chunk[misaligned]" in out.getvalue() or "FAIL" in out.getvalue()
    finally:
        _RULES["chunk"] = saved


# ---- a user's own fused layer --------------------------------------------------------------------------------
class FusedMLP(paddle.nn.Layer):
    """The PaddleFormers MLP pattern, written by a user: a fused [gate | up] projection chunked in two."""

    def __init__(self, hidden=8, inter=12):
        super().__init__()
        self.gate_up = paddle.nn.Linear(hidden, 2 * inter)
        self.down = paddle.nn.Linear(inter, hidden, bias_attr=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, axis=-1)
        return self.down(paddle.nn.functional.silu(gate) * up)


def _mlp_grads(dist, style=None):
    paddle.seed(3)
    model = FusedMLP()
    x = paddle.to_tensor(np.random.default_rng(1).standard_normal((4, 8)).astype("float32"))
    if dist:
        mesh = ap.ProcessMesh([0, 1], dim_names=["model"])
        model = ap.apply_tp(model, mesh, {"gate_up": style, "down": ap.RowWiseParallel()})
        x = ap.shard_tensor(x, mesh, [ap.Replicate()])
    loss = (model(x) ** 2).mean()
    loss.backward()
    from autoparallel.testing.paddleformers_models import _grad_np

    return float(loss), {n: _grad_np(p) for n, p in model.named_parameters()}


def test_fused_col_wise_parallel_on_a_users_layer_equals_one_process():
    ref = _mlp_grads(False)
    with ap.simulate(world_size=2):
        loss, grads = _mlp_grads(True, ap.FusedColWiseParallel(parts=(1, 1)))
    assert np.isclose(loss, ref[0], rtol=1e-5)
    for n, g in ref[1].items():
        np.testing.assert_allclose(grads[n], g, rtol=1e-4, atol=1e-6, err_msg=n)


def test_fused_style_with_parts_that_do_not_divide_the_features_is_a_plan_error():
    from autoparallel.parallel.tensor_parallel import PlanError

    with ap.simulate(world_size=2), pytest.raises(PlanError, match=r"24 output features do not divide into "
                                                                  r"blocks of relative sizes \(5, 2\)"):
        _mlp_grads(True, ap.FusedColWiseParallel(parts=(5, 2)))
    with pytest.raises(TypeError, match="expects a tuple of positive ints"):
        ap.FusedColWiseParallel(parts=(1, 0))


# ---- checkpoints -----------------------------------------------------------------------------------------------
def test_checkpoint_holds_the_global_tensor_and_reloads_into_any_layout(tmp_path):
    from autoparallel.checkpoint import load_merged_state_dict, load_state_dict, save_state_dict

    with ap.simulate(world_size=4):
        w = ap.shard_tensor(paddle.to_tensor(X), MESH, list(parse_placements("S(0),S(1,blocks=(8,4))")))
        save_state_dict({"w": w}, str(tmp_path / "ck"))
        np.testing.assert_array_equal(load_merged_state_dict(str(tmp_path / "ck"))["w"], X)
        for text in ("R,R", "R,S(1)", "S(1,blocks=(4,4,4)),S(0)"):
            dst = ap.shard_tensor(paddle.zeros([4, 12]), MESH, list(parse_placements(text)))
            load_state_dict({"w": dst}, str(tmp_path / "ck"))
            np.testing.assert_array_equal(dst.numpy(), X)


# ---- default plans on real models --------------------------------------------------------------------------
pf_needed = pytest.mark.skipif(not __import__("autoparallel.testing.paddleformers_models", fromlist=["x"]).available(),
                               reason="paddleformers not installed (pip install -e .[models])")


@pf_needed
def test_phi3_plans_block_shard_gate_up_and_qkv():
    from autoparallel.testing import paddleformers_models as pf
    from autoparallel.testing import paddleformers_runs as pc

    with ap.simulate(world_size=4):
        model, _ = pc.parallelized("phi3")
    layer = model.model.layers[0]
    assert str(layer.mlp.gate_up_proj.weight.placements) == f"[R, S(1,blocks=({pf.FFN},{pf.FFN}))]"
    hd = pf.HIDDEN // pf.HEADS
    q, kv = pf.HEADS * hd, pf.KV_HEADS * hd
    assert str(layer.self_attn.qkv_proj.weight.placements) == f"[R, S(1,blocks=({q},{kv},{kv}))]"


@pf_needed
@pytest.mark.parametrize("overrides", [{"num_key_value_heads": 1}, {"intermediate_size": 63}])
def test_blocks_tp_does_not_divide_fall_back_to_a_gathered_output(overrides):
    """kv heads < tp (the k and v blocks cannot split) or an odd intermediate size: column-parallel with the
    output gathered, still equal to one process."""
    from autoparallel.testing import paddleformers_models as pf
    from autoparallel.testing import paddleformers_runs as pc

    ref = pf.reference("phi3", **overrides)
    with ap.simulate(world_size=4):
        model, _ = pc.parallelized("phi3", **overrides)
        got = pc.parallelize_grads("phi3", **overrides)
    layer = model.model.layers[0]
    fallback = layer.self_attn.qkv_proj if "num_key_value_heads" in overrides else layer.mlp.gate_up_proj
    assert str(fallback.weight.placements) == "[R, S(1)]"
    assert pf.compare(ref, got) == []


@pf_needed
@pytest.mark.parametrize("stage", [0, 3])
def test_phi3_training_checkpoint_round_trip_with_block_sharded_weights(tmp_path, stage):
    """2 AdamW steps of Phi3 under parallelize (stage 0: plain; 3: ZeRO-3 over the data axis), saved: the
    file holds the global weights and moments of one process (un-permuted); loaded into a fresh run, one more
    step gives the same loss as continuing."""
    from autoparallel.checkpoint import load_merged_state_dict, load_state_dict, save_state_dict, training_state
    from autoparallel.testing import paddleformers_models as pf
    from autoparallel.testing import paddleformers_runs as pc

    ids, labels = (paddle.to_tensor(a) for a in pf.batch(0))

    def step(model, opt):
        loss = pf.loss_of(model(input_ids=ids, labels=labels))
        loss.backward()
        opt.step()
        opt.clear_grad()
        return float(loss)

    ref = pf.build("phi3", 0)
    ref_opt = paddle.optimizer.AdamW(1e-3, parameters=ref.parameters())
    for _ in range(2):
        step(ref, ref_opt)

    def built(seed):
        model = pf.build("phi3", seed)
        opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
        s = pc.strategy()
        if stage:
            s.sharding.enable, s.sharding.stage = True, stage
        return ap.parallelize(model, opt, strategy=s)

    with ap.simulate(world_size=4):
        model, opt = built(0)
        for _ in range(2):
            step(model, opt)
        save_state_dict(training_state(model, opt), str(tmp_path / "ck"))
        saved = load_merged_state_dict(str(tmp_path / "ck"), flat=True)
        name = "model.layers.0.mlp.gate_up_proj.weight"
        np.testing.assert_allclose(saved[f"model/{name}"], dict(ref.named_parameters())[name].numpy(),
                                   rtol=1e-4, atol=1e-5)
        fresh, fresh_opt = built(1)
        step(fresh, fresh_opt)                     # accumulators exist before loading into them
        load_state_dict(training_state(fresh, fresh_opt), str(tmp_path / "ck"))
        assert step(fresh, fresh_opt) == step(model, opt)


@pf_needed
@pytest.mark.parametrize("zero", [False, True])
def test_gradient_clipping_counts_every_block_piece(zero):
    """ClipGradByGlobalNorm over block-sharded gradients (each TP rank holds different pieces): 3 AdamW
    steps equal one process. Counting the pieces of one TP rank only (as for a replicated gradient) gives a
    smaller norm and a loss off by ~2e-4 at step 3."""
    from autoparallel.testing import paddleformers_models as pf
    from autoparallel.testing import paddleformers_runs as pc

    ids, labels = (paddle.to_tensor(a) for a in pf.batch(0))

    def run(dist):
        model = pf.build("phi3", 0)
        opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters(),
                                     grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5))
        if dist:
            s = pc.strategy()
            if zero:
                s.sharding.enable, s.sharding.stage = True, 1
            model, opt = ap.parallelize(model, opt, strategy=s)
        losses = []
        for _ in range(3):
            loss = pf.loss_of(model(input_ids=ids, labels=labels))
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
        return losses

    ref = run(False)
    with ap.simulate(world_size=4):
        got = run(True)
    np.testing.assert_allclose(got, ref, rtol=2e-5)


@pf_needed
def test_lazily_built_fused_model_falls_back_to_a_gathered_output():
    """Lazy initialisation fills one box per rank, which a block-sharded local is not: under
    paddle.LazyGuard the fused plans gather instead (still one process's values); a block-sharded
    shard_tensor of a lazy parameter is a typed error naming what works."""
    from autoparallel.testing import paddleformers_models as pf
    from autoparallel.testing import paddleformers_runs as pc

    ref = pf.reference("phi3")
    ids, labels = (paddle.to_tensor(a) for a in pf.batch(0))
    with ap.simulate(world_size=4):
        with paddle.LazyGuard():
            model = pf.build("phi3", 0)
        opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=pc.strategy())
        assert str(model.model.layers[0].mlp.gate_up_proj.weight.placements) == "[R, S(1)]"
        loss = pf.loss_of(model(input_ids=ids, labels=labels))
        loss.backward()
        opt.reduce_gradients()
        got = (float(loss), {n: pf._grad_np(p) for n, p in model.named_parameters()})
        assert pf.compare(ref, got) == []
        with paddle.LazyGuard():
            lin = paddle.nn.Linear(4, 8)
        with pytest.raises(NotImplementedError, match="lazy initialisation of a block-sharded parameter"):
            ap.shard_tensor(lin.weight, MESH, list(parse_placements("R,S(1,blocks=(4,4))")))


@pf_needed
def test_qwen2_moe_dense_fused_mlp_is_block_sharded_and_equals_one_process():
    """Qwen2-MoE without experts builds its MLP fused ([gate | up] in ``mlp.up_gate_proj``)."""
    from autoparallel.testing import paddleformers_models as pf
    from autoparallel.testing import paddleformers_runs as pc

    ref = pf.reference("qwen2_moe", num_experts=0)
    with ap.simulate(world_size=4):
        model, _ = pc.parallelized("qwen2_moe", num_experts=0)
        got = pc.parallelize_grads("qwen2_moe", num_experts=0)
    assert str(model.model.layers[0].mlp.up_gate_proj.weight.placements) == f"[R, S(1,blocks=({pf.FFN},{pf.FFN}))]"
    assert pf.compare(ref, got) == []
