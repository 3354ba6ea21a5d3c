"""A PaddleFormers model whose config carries PaddleFormers' own parallel / performance flags, handed to
``ap.parallelize`` and ``ap.shard_layer`` (simulated dp2 x tp2), against one process built with the same flags.
Flags the model only records or acts on by itself are honoured (same loss and gradients); flags that make the
model split itself, degrees that disagree with the strategy, and axes the library has none of are refused
before any work (docs/model_config_flags.md)."""
import numpy as np
import pytest

from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import paddle  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel import layer_state  # noqa: E402
from autoparallel.testing import paddleformers_runs as pr  # noqa: E402

# PaddleFormers 1.2 flags and the earlier PaddleNLP names: recorded or acted on by the model alone
HONOURED = dict(tensor_parallel_degree=2, tensor_parallel_rank=0, use_flash_attention=True, fuse_attention_qkv=True,
                fuse_attention_ffn=True, use_fused_rope=True, apply_rope_fusion=True, fuse_swiglu=True,
                use_fused_linear_cross_entropy=True,
                dpo=False, recompute=True, recompute_granularity="full", recompute_method="uniform",
                recompute_num_layers=1, tie_word_embeddings=True)


# Qwen3-MoE's own recompute fails in backward on one process (its recomputed attention sees 16 keys for 8 queries)
NO_RECOMPUTE = {k: v for k, v in HONOURED.items() if not k.startswith("recompute")}
# PaddleFormers' fused head + loss fails on one process together with its recompute: a run of its own
FUSED_HEAD = dict(use_fused_head_and_loss_fn=True, tie_word_embeddings=True, dpo=False)


@pytest.mark.parametrize("name, flags", [("llama", HONOURED), ("qwen3_moe", NO_RECOMPUTE), ("llama", FUSED_HEAD)])
def test_flags_the_model_handles_match_one_process(name, flags):
    ref = pf.reference(name, **flags)
    with ap.simulate(world_size=4):
        got = pr.parallelize_grads(name, **flags)
        seed = pf.sharded(name, "tp", **flags)
    assert pf.compare(ref, got) == []
    assert pf.compare(ref, seed) == []


def _model(**after):
    """llama built plain, then config flags set as a loaded config or a self-split build would carry them."""
    model = pf.build("llama", tie_word_embeddings=after.pop("tie_word_embeddings", True))
    for k, v in after.items():
        setattr(model.config, k, v)
    return model


def _parallelize(model, tp=2, pp=1):
    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    s = pr.strategy(dp=4 // (tp * pp), tp=tp)
    s.pipeline_parallel.degree = pp
    return ap.parallelize(model, opt, strategy=s)


def _untouched(model):
    assert layer_state.mesh_of(model) is None
    assert not any(hasattr(p, "full") for p in model.parameters())


@pytest.mark.parametrize("flags, says", [
    (dict(tensor_model_parallel_size=2), "tensor_model_parallel_size=2"),
    (dict(sequence_parallel=True), "sequence_parallel=True"),
])
def test_a_model_that_splits_itself_is_refused_by_both_entries(flags, says):
    with ap.simulate(world_size=4):
        model = _model(**flags)
        with pytest.raises(ValueError, match=says):
            _parallelize(model)
        _untouched(model)
        with pytest.raises(ValueError, match=says):
            ap.shard_layer(model, pf.mesh_2x2(), pf.seed_shard_fn)
        _untouched(model)


def _fleet_column(inner):
    """paddle.distributed.fleet's ColumnParallelLinear as a model built with tensor_model_parallel_size > 1 holds
    it (made without a fleet group, which a single process has not)."""
    from paddle.distributed.fleet.layers.mpu.mp_layers import ColumnParallelLinear

    layer = ColumnParallelLinear.__new__(ColumnParallelLinear)
    paddle.nn.Layer.__init__(layer)
    layer.weight = inner.weight
    return layer


def test_fleet_mpu_layers_are_refused():
    with ap.simulate(world_size=4):
        model = _model()
        attn = model.model.layers[0].self_attn
        attn.q_proj = _fleet_column(attn.q_proj)
        with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj is a paddle.distributed.fleet "
                                             "ColumnParallelLinear"):
            _parallelize(model)
        with pytest.raises(ValueError, match="ColumnParallelLinear"):
            ap.shard_layer(model, pf.mesh_2x2(), pf.seed_shard_fn)
        _untouched(model)


@pytest.mark.parametrize("flags, tp, pp, error, says", [
    (dict(tensor_parallel_degree=4), 2, 1, ValueError, r"tensor_parallel_degree=4 but strategy.tensor_parallel.degree=2"),
    (dict(tensor_model_parallel_size=1, tensor_parallel_degree=2), 1, 1, ValueError, r"degree=2 but strategy.tensor_parallel.degree=1"),
    (dict(pipeline_model_parallel_size=2), 2, 1, ValueError, r"pipeline_model_parallel_size=2 but strategy.pipeline_parallel.degree=1"),
    (dict(pipeline_parallel_degree=2), 2, 1, ValueError, r"set strategy.pipeline_parallel.degree=2"),
    (dict(virtual_pp_degree=2), 2, 1, ValueError, r"virtual_pp_degree=2 but strategy.pipeline_parallel.vpp_degree=1"),
    (dict(expert_model_parallel_size=2), 2, 1, NotImplementedError, r"expert_model_parallel_size=2 asks for expert"),
    (dict(expert_parallel_degree=2), 2, 1, NotImplementedError, r"expert parallelism"),
    (dict(context_parallel_degree=2), 2, 1, NotImplementedError, r"context_parallel_degree=2 asks for context"),
    (dict(sep_parallel_size=2), 2, 1, NotImplementedError, r"sep_parallel_size=1"),
])
def test_declared_degrees_must_be_the_strategys(flags, tp, pp, error, says):
    with ap.simulate(world_size=4):
        model = _model(**flags)
        with pytest.raises(error, match=says):
            _parallelize(model, tp=tp, pp=pp)
        _untouched(model)


def test_a_declared_pipeline_degree_equal_to_the_strategys_builds():
    """Negative control of the refusals: the same flag at the strategy's value passes the check."""
    with ap.simulate(world_size=4):
        model, _ = _parallelize(_model(pipeline_parallel_degree=2, tensor_parallel_degree=2, tie_word_embeddings=False), tp=2, pp=2)
        assert model is not None



@pytest.mark.parametrize("tie", [True, False])
def test_subbatched_fused_loss_matches_one_process(tie):
    """Sub-batching hands the (tied, vocab-split) head weight straight to PaddleFormers' fused-loss PyLayer;
    the tied embedding's gradient was 55% off (the PyLayer's share summed over the data axis)."""
    flags = dict(use_fused_head_and_loss_fn=True, loss_subbatch_sequence_length=4, tie_word_embeddings=tie)
    ref = pf.reference("llama", **flags)
    with ap.simulate(world_size=4):
        got = pr.parallelize_grads("llama", **flags)
    assert pf.compare(ref, got) == []


class _Head(paddle.autograd.PyLayer):
    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(h, w)
        return paddle.matmul(h, w, transpose_y=True).sum()

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensor()
        ones = paddle.ones([h.shape[0], w.shape[0]]) * g
        return paddle.matmul(ones, w), paddle.matmul(ones, h, transpose_x=True)


class _TiedHead(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.emb = paddle.nn.Embedding(16, 8)

    def forward(self, ids):
        return _Head.apply(self.emb(ids).reshape([-1, 8]), self.emb.weight)


def _tied_head_grad(distributed):
    paddle.seed(0)
    model = _TiedHead()
    ids = paddle.to_tensor([[0, 1], [2, 3], [4, 0], [1, 2]])
    if distributed:
        model, _ = ap.parallelize(model, paddle.optimizer.SGD(0.1, parameters=model.parameters()),
                                  strategy=pr.strategy(), tp_plan={"emb": ap.VocabParallelEmbedding()})
    model(ids).backward()
    p = model.emb.weight
    return (p.as_dist().grad.full() if distributed else p.grad).numpy()


def test_a_user_pylayer_reading_a_split_weight_the_lookup_also_uses():
    """Rows 5..15 get gradient only from the PyLayer: they came out exactly twice one process's."""
    ref = _tied_head_grad(False)
    with ap.simulate(world_size=4):
        got = _tied_head_grad(True)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
