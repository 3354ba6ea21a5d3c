"""ModelSpec.from_trace on the example models against the closed-form figures of the same dimensions.

Parameters must match exactly (the model's own count and ModelSpec's formula); the traced matmul FLOPs of a
block and of the LM head must equal the closed form b·s·(2·P_mm + 4·s·h) and 2·b·s·h·V exactly; all traced
FLOPs (element-wise ops counted one per output element, which the closed form leaves out) within 6%.
"""
import dataclasses

import paddle
import pytest


from models import PRESETS, build  # noqa: E402

from autoparallel.planner.model_spec import ModelSpec, parse_model, template_profile  # noqa: E402

ALL_FLOPS_TOLERANCE = 0.06


def traced(name, seq, batch, vocab=None):
    c = PRESETS[name]
    if vocab is not None:
        c = dataclasses.replace(c, vocab_size=vocab)
    model = build(c, lazy=True)                       # never allocated: tracing is spec-only
    return model, ModelSpec.from_trace(model, seq, batch)


@pytest.mark.parametrize("name,seq,batch,vocab", [("gpt-tiny", 16, 2, 256), ("llama-tiny", 16, 2, 256),
                                                  ("gpt-100m", 128, 1, None), ("llama-1b", 64, 1, None)])
def test_parameters_and_flops_match_the_closed_form(name, seq, batch, vocab):
    model, spec = traced(name, seq, batch, vocab)
    c = model.config
    assert spec.params == model.num_parameters()
    assert (spec.hidden, spec.layers, spec.heads, spec.vocab) == (c.hidden, c.layers, c.heads, c.vocab_size)
    # the same dimensions written out by hand give the same closed-form count
    closed = parse_model(f"hidden={c.hidden},layers={c.layers},heads={c.heads},vocab={c.vocab_size},"
                         f"ffn={spec.ffn},kv_heads={spec.kv_heads},swiglu={int(spec.swiglu)},seq={seq}")
    if spec.swiglu:
        assert closed.params == spec.params
    else:                                              # GPT: position table of max_positions rows, untied head?
        embeddings = c.max_positions * c.hidden + (0 if c.tie_embeddings else c.vocab_size * c.hidden)
        assert closed.layer_params == spec.layer_params
        assert spec.params == c.layers * closed.layer_params + c.vocab_size * c.hidden + embeddings + 2 * c.hidden
    f = spec.traced
    assert f.layer_params == spec.layer_params
    tokens = batch * seq
    assert f.layer_matmul_flops == tokens * spec.layer_forward_flops_per_token(seq)
    assert f.outside_matmul_flops == tokens * spec.logits_forward_flops_per_token()
    assert f.layer_flops == pytest.approx(f.layer_matmul_flops, rel=ALL_FLOPS_TOLERANCE)
    assert f.layer_flops > f.layer_matmul_flops                    # element-wise ops are counted too
    assert f.layer_activation_bytes > 0 and f.outside_activation_bytes > 0


def test_dimensions_read_off_the_structure():
    _, gpt = traced("gpt-tiny", 16, 2, 256)
    assert (gpt.ffn, gpt.kv_heads, gpt.swiglu, gpt.bias, gpt.layernorm, gpt.tied_embeddings,
            gpt.learned_positions, gpt.positions) == (128, 4, False, True, True, False, True, 16)
    _, llama = traced("llama-tiny", 16, 2, 256)
    assert (llama.ffn, llama.kv_heads, llama.swiglu, llama.bias, llama.layernorm, llama.learned_positions) == \
        (64, 2, True, False, False, False)
    _, tied = traced("gpt-100m", 64, 1)
    assert tied.tied_embeddings and tied.positions == 1024


def test_op_counts_match_the_template_and_the_dispatch_count():
    """The traced op profile equals the example-model template (used for presets without a trace), and the
    forward op count is what dispatch routes in an eager forward of the same model."""
    from autoparallel.planner.calib_worker import _count_dispatched

    for name in ("gpt-tiny", "llama-tiny"):
        _, spec = traced(name, 16, 2, 256)
        assert spec.ops == template_profile(spec)
    paddle.seed(0)
    model = build(dataclasses.replace(PRESETS["gpt-tiny"], vocab_size=256))
    spec = ModelSpec.from_trace(model, 16, 2)
    import autoparallel as ap
    import paddle.nn.functional as F

    mesh = ap.ProcessMesh([0], dim_names=["data"], create_groups=False)
    ap.shard_layer(model, mesh)
    ids = ap.shard_tensor(paddle.randint(0, 256, [2, 16]), mesh, [ap.Replicate()])
    count = _count_dispatched(lambda: F.cross_entropy(model(ids), ids))
    ops = spec.ops
    assert count == spec.layers * ops.layer_ops + ops.outside_ops
    assert (ops.layer_tensors, ops.outside_tensors) == (12, 5)
    assert spec.layers * ops.layer_tensors + ops.outside_tensors == len(model.parameters())


def test_not_a_transformer_is_a_typed_error():
    class MLP(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = paddle.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    with pytest.raises(ValueError, match="LayerList"):
        ModelSpec.from_trace(MLP(), 8, 2)
    with pytest.raises(ValueError, match="batch"):
        ModelSpec.from_trace(MLP(), 8, 0)


def test_traced_spec_plans():
    from autoparallel.planner.api import plan

    _, spec = traced("llama-1b", 2048, 1)
    result = plan(spec, "1x8:A100-80GB", global_batch_size=64, seq_len=2048, top=2)
    assert result.feasible and result.best.config.world == 8


def test_plan_accepts_a_paddle_model():
    """ap.plan traces a paddle model itself: the same ranking as planning its traced ModelSpec."""
    import autoparallel as ap

    model, spec = traced("gpt-tiny", 16, 1, 256)
    direct = ap.plan(model, "1x4:A100-80GB", global_batch_size=8, seq_len=16, top=3)
    via_spec = ap.plan(spec, "1x4:A100-80GB", global_batch_size=8, seq_len=16, top=3)
    assert [c.config for c in direct.candidates] == [c.config for c in via_spec.candidates]
    assert direct.model.params == model.num_parameters()
