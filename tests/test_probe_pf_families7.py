"""PaddleFormers families under the main entry points in combinations the family sweep, the shape probes and the
config fuzzer do not draw (simulated dp2 x tp2 world, 2 AdamW steps, losses and every state entry against one
process): family-specific options under TP + sequence parallel and TP + ZeRO-1 (Gemma3's softcapping, query
scalar and layer types, Phi3's longrope and partial rotary, Llama's MLP bias and pretraining_tp, GLM-4-MoE's qk
norm with partial rotary, DeepSeek-V3's greedy softmax gate, Qwen3-Next's linear-attention head counts, fused
qkv / gate-up projections over kv heads the TP degree does not divide); the sequence / token classification
heads under ``ap.parallelize`` with sequence parallel and ZeRO; ``ap.to_distributed`` choosing sequence
parallel for the MoE families; paddle's ``config=`` form with PaddleFormers' own Llama plan; a head count the
TP degree does not divide refused before any work."""
import os

import numpy as np
import pytest

from autoparallel.testing import paddleformers_models as pf
from dist_scripts import shared_launch

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import paddle  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel import layer_state  # noqa: E402
from autoparallel.testing import fuzz_runs  # noqa: E402
from autoparallel.testing import pf_fuzz as z  # noqa: E402
from autoparallel.testing.datasets import token_pair_loader  # noqa: E402

SP, TP_ZERO1 = z.PFStrategy("sp", 4, 2, 2, True), z.PFStrategy("dp_tp", 4, 2, 2, False, 1)
SP_ZERO3, TP4_SP = z.PFStrategy("sp", 4, 2, 2, True, 3), z.PFStrategy("sp", 4, 1, 4, True)
MOE = {"qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         shared_expert_intermediate_size=16),
       "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
       "glm4_moe": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
                        first_k_dense_replace=1),
       "deepseek_v3": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
                           q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                           first_k_dense_replace=1, n_group=2, topk_group=1),
       "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16, linear_key_head_dim=8, linear_value_head_dim=8,
                          linear_num_key_heads=2, linear_num_value_heads=4,
                          layer_types=["linear_attention", "full_attention"])}


def config(family, options=None, **dims):
    """A tiny PFConfig: hidden 32, 4 heads of 8 (2 kv heads), FFN 24, vocab 64, 2 layers, batch 4 x 6 tokens."""
    base = dict(seed=3, family=family, hidden=32, heads=4, kv_heads=4 if family == "deepseek_v3" else 2, head_dim=8,
                ffn=24, vocab=64, tie=False, bias=False, layers=2, seq=6, batch=4, ignored=False)
    extra = {**MOE.get(family, {}), **(options or {})}
    return z.PFConfig(**{**base, **dims}, extra=tuple(sorted(extra.items())))


LONGROPE = {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
FUSED = dict(fuse_attention_qkv=True, fuse_attention_ffn=True)
# (family, options, dims): each option changes the family's forward (checked against the plain config)
OPTIONS = [
    ("gemma3", dict(query_pre_attn_scalar=16), {}),
    ("gemma3", dict(final_logit_softcapping=5.0, attn_logit_softcapping=3.0), {}),
    ("gemma3", dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"]), {}),
    ("phi3", dict(rope_scaling=LONGROPE, original_max_position_embeddings=4), {}),
    ("phi3", dict(partial_rotary_factor=0.5), dict(kv_heads=1)),
    ("llama", dict(attention_bias=True, mlp_bias=True), dict(kv_heads=1)),
    ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}),
     dict(seq=7)),
    ("ernie4_5", dict(use_bias=True, rope_theta=100.0), dict(kv_heads=1)),
    ("glm4_moe", dict(use_qk_norm=True, partial_rotary_factor=0.5), {}),
    ("deepseek_v3", dict(attention_bias=True, topk_method="greedy", scoring_func="softmax", n_group=1), {}),
    ("qwen2_moe", dict(decoder_sparse_step=2, qkv_bias=True), dict(kv_heads=1)),
    ("qwen3_next", dict(linear_num_key_heads=1, linear_num_value_heads=3), {}),
    ("qwen2", FUSED, dict(heads=6, kv_heads=3, hidden=48)),
    ("gemma3", FUSED, dict(heads=6, kv_heads=3, hidden=48)),
    ("ernie4_5", FUSED, dict(heads=6, kv_heads=3, hidden=48, vocab=63, ffn=23, tie=True)),
    ("qwen3_moe", FUSED, dict(heads=6, kv_heads=3, hidden=48, seq=7)),
]


def _plain(cfg):
    return z.PFConfig(**{**cfg.__dict__, "extra": tuple(sorted(MOE.get(cfg.family, {}).items()))})


@pytest.mark.parametrize("family,options,dims", OPTIONS,
                         ids=[f"{f}-{'-'.join(o)}-{'-'.join(f'{k}{v}' for k, v in d.items())}" for f, o, d in OPTIONS])
@pytest.mark.parametrize("sspec", [SP, TP_ZERO1], ids=["tp2-sp", "tp2-zero1"])
def test_family_option_under_tensor_parallel_equals_one_process(family, options, dims, sspec):
    cfg = config(family, options, **dims)
    out = z.run(cfg, sspec)
    assert out.status == "ok", f"{out.status}: {out.detail}"
    if sspec is not SP:
        return
    if options is FUSED:                      # a layout, not a forward change: the fused layers are there
        names = [n for n, _ in z.build(cfg).named_sublayers()]
        assert any(n.endswith("qkv_proj") for n in names) and any(n.endswith("up_gate_proj") for n in names)
    else:                                     # the option is live: the one-process run without it differs
        assert fuzz_runs.compare(z.reference(cfg), z.reference(_plain(cfg)))


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "qwen3_moe", "ernie4_5"])
def test_fused_projections_one_kv_head_over_tp4_with_sequence_parallel(family):
    out = z.run(config(family, FUSED, vocab=63, ffn=23, tie=True, seq=7, batch=3, kv_heads=1), TP4_SP)
    assert out.status == "ok", f"{out.status}: {out.detail}"


# ---- heads under ap.parallelize ----------------------------------------------------------------------------
HEAD_DIMS = dict(hidden_size=32, intermediate_size=24, num_attention_heads=4, vocab_size=pf.VOCAB)


def _strategy(kind):
    s = ap.Strategy()
    s.data_parallel.degree = 4 if kind == "zero3" else 2
    s.tensor_parallel.degree = 1 if kind == "zero3" else 2
    s.sequence_parallel.enable = kind.startswith("sp")
    if kind in ("zero3", "sp-zero3", "tp-zero1"):
        s.sharding.enable, s.sharding.stage = True, int(kind[-1])
    return s


def _tensors(batch):
    return {k: _tensors(v) if isinstance(v, dict) else paddle.to_tensor(v) for k, v in batch.items()}


def _train_head(cls, kind, left, mode):
    family = pf.HEAD_CLASSES[cls][0]
    labels = 1 if kind == "regression" else 3
    extra = {"embedding_negatives_cross_device": False} if kind == "pairs" else {}
    model = pf.build_head(cls, num_labels=labels, num_key_value_heads=4 if family == "deepseek_v3" else 2,
                          **HEAD_DIMS, **extra)
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters(), epsilon=1e-3)
    if mode is not None:
        model, opt = ap.parallelize(model, opt, strategy=_strategy(mode))
    losses = []
    for step in range(2):
        batch = pf.head_batch(kind, seed=step, left=left, num_labels=labels)
        out = model(**_tensors(batch))
        loss = out if hasattr(out, "backward") and not isinstance(out, (tuple, list, dict)) else pf.loss_of(out)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    state = ap.full_state_dict(model) if mode is not None else model.state_dict()
    return losses, {k: np.asarray(v.numpy()) for k, v in state.items()}


@pytest.mark.parametrize("cls,kind,left,mode", [
    ("Qwen2ForSequenceClassification", "class", False, "sp"), ("Qwen3ForSequenceClassification", "class", True,
                                                                "sp-zero3"),
    ("Qwen2ForSequenceClassification", "regression", False, "sp-zero3"),
    ("Qwen3ForSequenceClassification", "multi", True, "tp-zero1"),
    ("Qwen2ForTokenClassification", "token", True, "sp"), ("Qwen3ForTokenClassification", "token", False, "tp-zero1"),
    ("DeepseekV3ForSequenceClassification", "class", True, "sp"),
    ("DeepseekV3ForSequenceClassification", "class", False, "zero3"),
    ("Qwen3SentenceEmbedding", "pairs", True, "sp-zero3"), ("Qwen2SentenceEmbedding", "pairs", False, "sp"),
])
def test_classification_heads_under_parallelize(cls, kind, left, mode):
    """Last-token pooling by pad_token_id (left or right padding; class ids, a regression target, multi-label),
    per-token labels with -100 on padding, sentence embeddings at given last-token indices with in-batch
    negatives, the decoder's hidden states sequence-sharded under sequence parallel: 2 AdamW steps equal one
    process."""
    ref = _train_head(cls, kind, left, None)
    with ap.simulate(world_size=4):
        got = _train_head(cls, kind, left, mode)
    assert fuzz_runs.compare(ref, got) == ""
    assert ref[0][0] != ref[0][1]                            # the first step moved the model


def test_head_comparison_catches_unreduced_gradients():
    """Negative control: the same head run with its data-parallel gradients never reduced does not compare equal."""
    from autoparallel.testing.negative import no_gradient_reduction

    cls = "Qwen2ForSequenceClassification"
    ref = _train_head(cls, "class", False, None)
    with ap.simulate(world_size=4), no_gradient_reduction():
        got = _train_head(cls, "class", False, "sp")
    assert fuzz_runs.compare(ref, got) != ""


# ---- ap.to_distributed -------------------------------------------------------------------------------------
B, T = 4, 8


def _loader():
    return token_pair_loader(pf.VOCAB, B, T)


def _build(family):
    model = pf.build(family, fill_zeros=True, hidden_size=32, intermediate_size=24)
    return model, paddle.optimizer.AdamW(1e-3, parameters=model.parameters(), epsilon=1e-3)


def _train_loader(model, opt, dist_loader):
    losses = []
    for _, (inputs, labels) in enumerate(dist_loader()):
        loss = pf.loss_of(model(input_ids=inputs, labels=labels))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: (p.full().numpy() if hasattr(p, "full") else p.numpy()) for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss", "deepseek_v3", "qwen3_next", "phi3"])
def test_to_distributed_with_sequence_parallel_equals_one_process(family):
    ref = _train_loader(*_build(family), _loader)
    with ap.simulate(world_size=4):
        cfg = ap.ToDistributedConfig()
        cfg.sequence_parallel = True
        cfg.input_spec = [paddle.static.InputSpec([B, T], "int64", "input_ids")]
        model, opt, dist_loader = ap.to_distributed(*_build(family), _loader(), device_num=4, node_num=1, config=cfg)
        chosen = ap.chosen_strategy(model)
        assert chosen.sequence_parallel.enable and chosen.tensor_parallel.degree == 2
        got = _train_loader(model, opt, dist_loader)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    assert [n for n in ref[1] if not np.allclose(got[1][n], ref[1][n], 1e-4, 1e-5)] == []


# ---- paddle's config= form with PaddleFormers' own plan ----------------------------------------------------
def _own_plan(model):
    model.config.use_single_model_implementation = True
    return model.auto_dist_config()["mp_config"]["parallelize_plan"]


def _paddle_mesh():
    import paddle.distributed as dist

    return dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


def test_the_models_own_plan_as_written_is_refused_naming_the_key():
    """PaddleFormers 1.2's Llama plan names ``llama.*`` layers, which its LlamaForCausalLM (``model.*``) does not
    have: paddle would shard the head only; the key is refused before any parameter is touched."""
    with ap.simulate(world_size=4):
        model = pf.build("llama")
        plan = _own_plan(model)
        opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
        with pytest.raises(ValueError, match="'llama.embed_tokens' matches no layer of LlamaForCausalLM"):
            ap.parallelize(model, opt, mesh=_paddle_mesh(), config={"mp_config": {"parallelize_plan": plan}})
        assert layer_state.mesh_of(model) is None
        assert not any(hasattr(p, "full") for p in model.parameters())


@pytest.mark.parametrize("level", [0, 1, 3])
@pytest.mark.parametrize("tie", [True, False])
def test_the_models_own_plan_for_its_layers_equals_one_process(level, tie):
    """The same plan on the model's own layer names (its paddle ColWiseParallel(gather_output=True) embedding,
    a ``lm_head.weight`` parameter key), with paddle's sharding_level: 2 AdamW steps equal one process."""
    import re

    def train(model, opt):
        losses = []
        for step in range(2):
            ids, labels = pf.batch(step, vocab=63)
            loss = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
        return losses

    def build():
        model = pf.build("llama", fill_zeros=True, tie_word_embeddings=tie, hidden_size=32, intermediate_size=24,
                         vocab_size=63)
        return model, paddle.optimizer.AdamW(1e-3, parameters=model.parameters(), epsilon=1e-3)

    model, opt = build()
    ref = train(model, opt), {k: v.numpy() for k, v in model.state_dict().items()}
    with ap.simulate(world_size=4):
        model, opt = build()
        names = [n for n, _ in model.named_sublayers()]
        plan = {k.replace("llama.", "model."): v for k, v in _own_plan(model).items()}
        plan = {k: v for k, v in plan.items() if any(re.fullmatch(k.removesuffix(".weight"), n) for n in names)}
        assert len(plan) == 9 and "lm_head.weight" in plan
        model, opt = ap.parallelize(model, opt, mesh=_paddle_mesh(), config={
            "mp_config": {"parallelize_plan": plan}, "dp_config": {"sharding_level": level}})
        got = train(model, opt), {k: np.asarray(v.numpy()) for k, v in ap.full_state_dict(model).items()}
    assert fuzz_runs.compare(ref, got) == ""


def test_heads_the_tp_degree_does_not_divide_are_refused_before_any_work():
    with ap.simulate(world_size=4):
        model = z.build(config("qwen3_moe", heads=6, kv_heads=2, hidden=48))
        opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
        with pytest.raises(ValueError, match="tensor_parallel.degree=4 must divide the model's heads=6"):
            ap.parallelize(model, opt, strategy=z.make_strategy(z.PFStrategy("tp", 4, 1, 4), None))
        assert layer_state.mesh_of(model) is None
        assert not any(hasattr(p, "full") for p in model.parameters())


# ---- 4 real gloo ranks --------------------------------------------------------------------------------------
JOB = shared_launch.job(__name__, "pf_families7", os.path.join(os.path.dirname(__file__), "dist_scripts",
                                                               "pf_families7_worker.py"), 4, timeout=300)


def test_on_real_ranks_options_and_a_head_equal_one_process():
    """Gemma3's softcapping under SP + ZeRO-3, Phi3's longrope with one kv head under TP + ZeRO-1, a left-padded
    sequence classifier under SP + ZeRO-3."""
    _, ranks = shared_launch.results(JOB)
    assert len(ranks) == 4
    for res in ranks:
        assert [r["case"] for r in res] == ["gemma3", "phi3", "Qwen2ForSequenceClassification"]
        assert all(r["diff"] == "" for r in res), [(r["case"], r["diff"]) for r in res]
        assert all(r["losses"][1] != r["losses"][0] for r in res)
