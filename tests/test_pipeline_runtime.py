"""Pipeline runtime in one process: every stage here, the ranks' action lists interleaved (a transfer is a
hand-off), the same code path as on real ranks. Stage splitting, the zero-bubble backward split,
shape headers, optimizer binding, and bad input rejected before any process-group work."""

import numpy as np
import paddle
import pytest


import pp_common  # noqa: E402

from autoparallel.parallel.pipeline import make_schedule, p2p, runtime, zero_bubble  # noqa: E402
from autoparallel.parallel.pipeline.runtime import apply_pp  # noqa: E402
from autoparallel.parallel.pipeline.stage import (  # noqa: E402
    PipelineStage, build_stages, describe_model, layer_costs, plan_pipeline)

RTOL, ATOL = 1e-4, 2e-5
_REFS = {}


def ref(kind="gpt", tie=False):
    if (kind, tie) not in _REFS:
        _REFS[(kind, tie)] = pp_common.reference(kind, tie)
    return _REFS[(kind, tie)]


def assert_matches(job, losses, params):
    ref_losses, ref_params = ref(job.get("kind", "gpt"), job.get("tie", False))
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=1e-6)
    assert set(params) == set(ref_params)
    for n, p in params.items():
        np.testing.assert_allclose(p, ref_params[n], rtol=RTOL, atol=ATOL, err_msg=n)


JOBS = [{"schedule": "FThenB"}, {"schedule": "1F1B", "tie": True}, {"schedule": "VPP", "vpp": 2},
        {"schedule": "ZB-H1", "tie": True}, {"schedule": "1F1B", "kind": "llama", "tie": True},
        {"schedule": "ZB-H1", "kind": "llama"}, {"schedule": "1F1B", "pp": 4, "mb": 4, "tie": True},
        {"schedule": "VPP", "vpp": 2, "mb": 2, "split_points": ["blocks.1", "blocks.2", "blocks.3"]}]


@pytest.mark.parametrize("job", JOBS, ids=lambda j: "-".join(str(v) for v in j.values() if not isinstance(v, list)))
def test_single_process_pipeline_equals_one_big_batch(job):
    losses, pipe = pp_common.run_pipeline(job)
    assert_matches(job, losses, {n: p.numpy() for n, p in pipe.named_parameters()})
    assert losses[-1] < losses[0] - 0.5                          # it learns
    kinds = {r.kind for r in pipe.records}
    assert kinds == ({"F", "B", "W"} if job["schedule"] == "ZB-H1" else {"F", "B"}) | \
        {"SEND_F", "RECV_F", "SEND_B", "RECV_B"}
    assert len(pipe.records) == sum(len(acts) for acts in pipe.schedule)


def test_negative_control_micro_batch_labels_out_of_order(monkeypatch):
    """The same comparison fails when the last stage pairs micro-batch i with the labels of another one."""
    split = runtime.PipelineModule._micro

    def shifted(self, batch, what):
        parts = split(self, batch, what)
        return parts[1:] + parts[:1] if what == "labels" else parts

    monkeypatch.setattr(runtime.PipelineModule, "_micro", shifted)
    losses, pipe = pp_common.run_pipeline({"schedule": "1F1B"})
    params = {n: p.numpy() for n, p in pipe.named_parameters()}
    with pytest.raises(AssertionError):
        assert_matches({}, losses, params)
    ref_params = ref()[1]
    name = "blocks.0.mlp.fc1.weight"
    assert not np.allclose(params[name], ref_params[name], rtol=RTOL, atol=ATOL)


# ---- zero bubble ---------------------------------------------------------------------------------------------
def test_zero_bubble_defers_linear_weight_gradients():
    paddle.seed(0)
    nn = paddle.nn
    layer = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3, bias_attr=False))
    x = paddle.randn([2, 4, 6])
    x.stop_gradient = False
    layer(x).square().sum().backward()
    want = {n: p.grad.numpy().copy() for n, p in layer.named_parameters()}
    want_x = x.grad.numpy().copy()
    layer.clear_gradients(set_to_zero=False)
    x.clear_gradient(set_to_zero=False)
    assert zero_bubble.install(layer) == 2 and zero_bubble.install(layer) == 0
    store = zero_bubble.WeightGradStore()
    with store.capture("k"):
        layer(x).square().sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), want_x, rtol=1e-6)            # B: input gradient complete
    assert layer[0].weight.grad is None and layer[0].bias.grad is None and layer[2].weight.grad is None
    assert layer[1].weight.grad is not None                                    # other ops: whole backward in B
    assert len(store) == 2 and store.flush("k") == 2 and len(store) == 0       # W
    for n, p in layer.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), want[n], rtol=1e-5, atol=1e-7, err_msg=n)
    layer(x).square().sum().backward()                                         # outside capture: immediate
    np.testing.assert_allclose(layer[0].weight.grad.numpy(), 2 * want["0.weight"], rtol=1e-5, atol=1e-7)


# ---- stages ---------------------------------------------------------------------------------------------------
def test_stages_keep_model_names_and_find_embedding_and_head_pieces():
    tied = describe_model(pp_common.build("gpt", tie=True))
    assert tied.layers_name == "blocks" and tied.embed_layers == ("wte", "wpe") and tied.head_layers == ("wte", "ln_f")
    plain = describe_model(pp_common.build("gpt"))
    assert plain.head_layers == ("ln_f", "lm_head")
    llama = describe_model(pp_common.build("llama", tie=True))
    assert llama.layers_name == "layers" and llama.embed_layers == ("embed_tokens",)
    assert llama.head_layers == ("embed_tokens", "norm")
    stages = build_stages(tied, [(0, 1), (1, 3), (3, 4)])
    names = [sorted({n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("blocks") else "")
                     for n, _ in s.named_parameters()}) for s in stages]
    assert names == [["blocks.0", "wpe", "wte"], ["blocks.1", "blocks.2"], ["blocks.3", "ln_f", "wte"]]
    assert stages[2].wte is stages[0].wte                                      # the tied layer itself
    model = pp_common.build("gpt")
    ids = paddle.to_tensor(pp_common.batches(1)[0][0])
    x = ids
    for st in build_stages(describe_model(model), [(0, 2), (2, 4)]):
        x = st(x)
    np.testing.assert_allclose(x.numpy(), model(ids).numpy(), rtol=1e-6, atol=1e-6)


def test_balanced_split_uses_traced_flops_with_embedding_and_head():
    from examples.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=4096, hidden=32, layers=6, heads=4, max_positions=16))
    pieces = describe_model(model)
    flops, params = layer_costs(pieces, "flops"), layer_costs(pieces, "params")
    assert flops[1] == flops[2] and flops[-1] > 2 * flops[1]                 # the LM head is the big one
    assert params[0] > params[1]                                              # embeddings counted on layer 0
    plan = plan_pipeline(model, 2, 4, "1F1B")
    assert plan.bounds[1][1] - plan.bounds[1][0] < 3                          # the head's stage gets fewer blocks
    assert plan_pipeline(model, 2, 4, "1F1B", split_points=["blocks.3"]).bounds == [(0, 3), (3, 6)]


class _NoPieces(paddle.nn.Layer):
    def forward(self, x):
        return x


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(pp=8, micro_batches=8), ValueError, "more stages than layers"),
    (dict(pp=2, micro_batches=4, schedule="VPP", vpp=4), ValueError, "more stages than layers"),
    (dict(pp=2, micro_batches=1, schedule="1F1B"), ValueError, "micro_batches >= pipeline stages.*FThenB"),
    (dict(pp=2, micro_batches=1, schedule="ZB-H1"), ValueError, "micro_batches=1 < pp=2"),
    (dict(pp=2, micro_batches=4, split_points=["blocks.9"]), ValueError, "split point 'blocks.9' names no layer"),
    (dict(pp=2, micro_batches=4, split_points=["block.2"]), ValueError, "names no layer.*blocks"),
    (dict(pp=3, micro_batches=4, split_points=["blocks.2"]), ValueError, "1 split points make 2 stages"),
    (dict(pp=2, micro_batches=4, schedule="Gpipe"), ValueError, "unknown pipeline schedule 'Gpipe'"),
    (dict(pp=1, micro_batches=4), ValueError, "pipeline_parallel.degree >= 2"),
    (dict(pp=2, micro_batches=4, split_points="blocks.2"), TypeError, "list of layer names"),
])
def test_bad_plans_raise_typed_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        plan_pipeline(pp_common.build("gpt"), **kwargs)


def test_model_without_pipeline_pieces():
    with pytest.raises(TypeError, match="expected embed.* and head.* methods, or a paddle.nn.LayerList / Sequential "
                                        "of repeated same-type layers; found neither"):
        describe_model(_NoPieces())


@pytest.fixture
def no_group_work(monkeypatch):
    """A world of 4 ranks in which any process-group creation fails the test."""
    def forbidden(*a, **k):
        raise AssertionError("process-group work before the input was validated")

    monkeypatch.setattr(runtime, "_world", lambda: (4, 0))
    monkeypatch.setattr(p2p, "create_groups", forbidden)
    monkeypatch.setattr(runtime, "_stage_meshes", forbidden)


@pytest.mark.parametrize("setup,match", [
    (dict(degree=4, micro_batches=8, schedule="VPP", vpp=2), "= 8 stages exceed the model's layers=4"),
    (dict(degree=4, micro_batches=2, schedule="1F1B"), "needs at least pipeline_parallel.degree=4 micro-batches"),
    (dict(degree=2, micro_batches=4, split_points=["blocks.7"]), "split point 'blocks.7' names no layer"),
    (dict(degree=2, micro_batches=4, tp=2), "needs a tp_plan"),
    (dict(degree=2, micro_batches=4, dp=4), "expected the world size 4"),
])
def test_apply_pp_rejects_bad_strategies_before_group_work(no_group_work, setup, match):
    s = pp_common.strategy({"schedule": setup.get("schedule", "1F1B"), "pp": setup["degree"],
                            "vpp": setup.get("vpp", 1), "mb": setup["micro_batches"],
                            "split_points": setup.get("split_points"),
                            "dp": setup.get("dp", 4 // setup["degree"] // setup.get("tp", 1)),
                            "tp": setup.get("tp", 1)})
    with pytest.raises(ValueError, match=match):
        apply_pp(pp_common.build("gpt"), s)


def test_unknown_schedule_name_is_rejected_by_the_strategy_and_the_planner():
    s = pp_common.strategy({"schedule": "1F1B"})
    with pytest.raises(ValueError, match="schedule must be 'FThenB', '1F1B', 'VPP' or 'ZB-H1', got 'Interleaved'"):
        s.pipeline_parallel.schedule = "Interleaved"
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb-v'"):
        make_schedule("zb-v", 2, 4)


def test_train_batch_checks_the_batch():
    _, pipe = pp_common.run_pipeline({"schedule": "1F1B"}, steps=1)
    x, y = pp_common.batches(1)[0]
    with pytest.raises(ValueError, match=r"global batch \(6 samples\) must divide into micro_batches x "
                                         r"data-parallel degree = 4 x 1"):
        pipe.train_batch(x[:6], y[:6])
    with pytest.raises(ValueError, match="one tensor per micro-batch \\(4\\), got 2"):
        pipe.train_batch([x[:2], x[2:4]], y)
    with pytest.raises(ValueError, match="needs the labels; got None"):
        pipe.train_batch(x, None)
    from autoparallel import ProcessMesh, Replicate, shard_tensor

    dist_x = shard_tensor(paddle.to_tensor(x), ProcessMesh([0], ["data"], create_groups=False), [Replicate()])
    with pytest.raises(TypeError, match="expected the global batch as plain tensors"):
        pipe.train_batch(dist_x, y)


def test_optimizer_is_bound_to_the_stage_parameters():
    model = pp_common.build("gpt", tie=True)
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    pipe = apply_pp(model, pp_common.strategy({"schedule": "1F1B"}))
    pipe.held = [1]                                           # as pipeline rank 1 would see it
    pipe.held_stages = [1]
    wrapped = pipe.wrap_optimizer(opt)
    names = {p.name for p in wrapped.parameters}
    want = {p.name for st in pipe.stages[1:] for p in st.parameters()}
    assert names == want and model.wte.weight.name in names and model.wpe.weight.name not in names
    clipped = paddle.optimizer.AdamW(1e-3, parameters=model.parameters(), grad_clip=paddle.nn.ClipGradByValue(1.0))
    with pytest.raises(NotImplementedError, match="supports ClipGradByGlobalNorm.*got ClipGradByValue"):
        pipe.wrap_optimizer(clipped)


# ---- p2p headers ----------------------------------------------------------------------------------------------
def test_shape_header_round_trip_and_limits():
    for shape, dtype in (([2, 16, 32], "float32"), ([3], "int64"), ([1, 2, 3, 4, 5, 6], "bfloat16")):
        t = paddle.zeros(shape, dtype=dtype)
        assert p2p.decode_header(p2p.encode_header(t)) == (shape, dtype)
    with pytest.raises(ValueError, match="at most 6 dims, got shape"):
        p2p.encode_header(paddle.zeros([1] * 7))
    with pytest.raises(RuntimeError, match="disagree on the message order"):
        p2p.decode_header(paddle.to_tensor([99, 0, 0, 0, 0, 0, 0, 0], dtype="int64"))


def test_pair_groups_follow_the_schedule_and_the_mesh():
    ranks = runtime.pipeline_ranks(2, 2, 2)
    pairs = runtime._p2p_pairs(make_schedule("1F1B", 2, 4), ranks)
    assert pairs == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert runtime._p2p_pairs(make_schedule("1F1B", 4, 4), runtime.pipeline_ranks(4)) == [(0, 1), (1, 2), (2, 3)]
    assert runtime._p2p_pairs(make_schedule("VPP", 4, 4, 2), runtime.pipeline_ranks(4)) == \
        [(0, 1), (0, 3), (1, 2), (2, 3)]
    from autoparallel.mesh import ProcessMesh

    mesh = ProcessMesh([[0, 2], [1, 3]], ["data", "pipe"], create_groups=False)
    assert runtime.pipeline_ranks(2, 2, 1, mesh).tolist() == [[[0], [1]], [[2], [3]]]
    with pytest.raises(ValueError, match=r"expected the degrees \[pp, dp, tp\] = \[4, 1, 1\]"):
        runtime.pipeline_ranks(4, 1, 1, mesh)
    with pytest.raises(ValueError, match="including 'pipe'"):
        runtime.pipeline_ranks(2, 2, 1, ProcessMesh([[0, 1], [2, 3]], ["data", "model"], create_groups=False))


def test_stage_is_a_layer_with_only_its_own_parameters():
    pieces = describe_model(pp_common.build("gpt"))
    st = PipelineStage(pieces, 1, 2, (2, 4))
    assert isinstance(st, paddle.nn.Layer) and "stage=1/2" in repr(st)
    assert {n.split(".")[0] for n, _ in st.named_parameters()} == {"blocks", "ln_f", "lm_head"}
