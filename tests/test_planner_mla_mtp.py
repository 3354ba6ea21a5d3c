"""Multi-head latent attention, multi-token prediction and fp8 per GEMM class in the planner, figures by hand.

Sources: DeepSeek-AI 2024 (arXiv:2412.19437) §2.1.1 (MLA), §2.2 (MTP), §3.3.1 (fp8 mixed precision);
deepseek-ai/DeepSeek-V3 config.json (ranks and head widths).
"""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from autoparallel.planner import memory as mem
from autoparallel.planner import options as options_module
from autoparallel.planner.cluster import DEVICES
from autoparallel.planner.cost_model import _time_per_layer, layer_forward_flops
from autoparallel.planner.model_read import mla_fields
from autoparallel.planner.model_spec import PRESETS, ModelSpec
from autoparallel.planner.mtp import mtp_activation_bytes
from autoparallel.planner.params import mtp_params_on_device
from autoparallel.planner.options import PlannerOptions
from autoparallel.planner.params import block_and_edge_params
from autoparallel.planner.published import MOE_RUNS, run_cluster
from autoparallel.planner.search import evaluate_config

LLAMA_STYLE = dict(swiglu=True, bias=False, layernorm=False, tied_embeddings=False, learned_positions=False,
                   dropout=False)
# h 64, 4 heads, q/k heads of 12 (8 + rope 4), v heads of 8, r_q 16, r_kv 8, SwiGLU MLP of 96
TINY_MLA = ModelSpec("mla-tiny", 64, 2, 4, 100, ffn=96, qk_head_dim=12, v_head_dim=8, q_lora_rank=16,
                     kv_lora_rank=8, qk_rope_head_dim=4, **LLAMA_STYLE)


def test_mla_parameters_flops_and_activations_by_hand():
    m = TINY_MLA
    # split by TP: q_b 16·4·12 = 768, kv_b 8·4·(12 - 4 + 8) = 512, o 4·8·64 = 2048
    # replicated: q_a 64·16 = 1024, kv_a 64·(8 + 4) = 768
    assert m.attention_params == (768 + 512 + 2048, 1024 + 768)
    assert m.layer_matmul_params == 3328 + 3 * 64 * 96                       # 21760
    assert m.layer_other_params == 2 * 64 + 16 + 8 + 1792                    # norms, latent norms, down-projections
    assert m.params == 2 * (21760 + 1944) + 100 * 64 + 100 * 64 + 64         # 60272
    # attention core over s = 32 keys: 2·s·a·(d_qk + d_v) = 2·32·4·20
    assert m.attention_core_flops_per_token(32) == 5120
    assert m.layer_forward_flops_per_token(32) == 2 * 21760 + 2 * 1792 + 5120   # 52224
    # Q, K 2·a·d_qk and V, output 2·a·d_v bytes per token: 4·4·20/64 = 5; latents 4·(16 + 8)/64 = 1.5
    assert mem.attention_activation_coefficients(m) == (5.0, 1.5)
    assert mem.activation_coefficients(m) == (5.0 + 6 * 96 / 64, 8.0 + 1.5, 2.0)
    # TP 2 splits all but the down-projections (2·1792 FLOPs per token), which SP splits
    assert layer_forward_flops(m, 32, 1, 2) == 32 * ((52224 - 3584) / 2 + 3584)          # 892928
    assert layer_forward_flops(m, 32, 1, 2, 2) == 32 * ((52224 - 3584) / 2 + 3584 / 2)   # 835584


def test_multi_head_attention_is_unchanged_by_the_head_widths():
    llama = PRESETS["llama2-70b"]
    assert llama.attention_core_flops_per_token(4096) == 4.0 * 4096 * 8192          # 4·s·h
    assert llama.attention_params == (2 * 8192 * 8192 + 2 * 8192 * 1024, 0)        # q, out + k, v of 8 kv heads
    assert mem.attention_activation_coefficients(llama) == (2.0 + 4.0 * 1024 / 8192 + 2.0, 0.0)
    wide = ModelSpec("qwen3-like", 40, 2, 4, 100, attn_dim=64, **LLAMA_STYLE)      # heads of 16, hidden 40
    assert wide.attention_core_flops_per_token(10) == 4.0 * 10 * 64
    assert wide.attention_params == (40 * 64 * 2 + 2 * 40 * 64, 0)


def test_mla_bad_input_is_refused():
    with pytest.raises(ValueError, match="need kv_lora_rank > 0"):
        ModelSpec("bad", 64, 2, 4, 100, q_lora_rank=16)
    with pytest.raises(ValueError, match="kv_heads must equal heads"):
        ModelSpec("bad", 64, 2, 4, 100, kv_heads=2, kv_lora_rank=8, qk_rope_head_dim=4, qk_head_dim=12)
    with pytest.raises(ValueError, match="qk_rope_head_dim .12. must be smaller"):
        ModelSpec("bad", 64, 2, 4, 100, kv_lora_rank=8, qk_rope_head_dim=12, qk_head_dim=12)
    with pytest.raises(ValueError, match="mtp_depth must be a non-negative integer"):
        ModelSpec("bad", 64, 2, 4, 100, mtp_depth=-1)


def test_deepseek_v3_preset_by_hand():
    ds = PRESETS["deepseek-v3"]
    # MLA (config.json): q_b 1536·128·192, kv_b 512·128·(128 + 128), o 128·128·7168; q_a 7168·1536, kv_a 7168·576
    assert ds.attention_params == (37748736 + 16777216 + 117440512, 11010048 + 4128768)
    e = 3 * 7168 * 2048                                                        # one expert (SwiGLU of 2048)
    dense_block = 171966464 + 15138816 + 2 * 7168 + 1536 + 512 + 3 * 7168 * 18432
    moe_block = 171966464 + 15138816 + 2 * 7168 + 1536 + 512 + e + 7168 * 256 + 256 * e
    edges = 2 * 129280 * 7168 + 7168
    mtp = moe_block + 2 * 7168 * 7168 + 3 * 7168                               # block, 2h x h projection, 3 norms
    assert ds.mtp_module_params == mtp == 11610067968
    assert ds.params == 3 * dense_block + 58 * moe_block + edges + mtp        # 671.0B + 11.6B of MTP
    assert ds.params - mtp == 671026404352                                     # the paper's 671B
    # the 3 dense blocks are priced: FLOPs per token averaged over 3 dense and 58 MoE blocks (top-8 + 1 shared)
    dense_fwd = 2 * (171966464 + 15138816 + 3 * 7168 * 18432)
    moe_fwd = 2 * (171966464 + 15138816 + e + 7168 * 256 + 8 * e)
    core = ds.attention_core_flops_per_token(4096)
    assert core == 2 * 4096 * 128 * (192 + 128)
    assert ds.layer_forward_flops_per_token(4096) - core == pytest.approx((3 * dense_fwd + 58 * moe_fwd) / 61,
                                                                         rel=1e-12)
    assert (ds.experts, ds.top_k, ds.expert_ffn, ds.shared_experts, ds.dense_layers, ds.route_nodes) == \
        (256, 8, 2048, 1, 3, 4)


TINY_MTP = ModelSpec("mtp-tiny", 64, 2, 4, 100, ffn=96, mtp_depth=1, **LLAMA_STYLE)


def test_multi_token_prediction_by_hand():
    m = TINY_MTP
    block = 4 * 64 * 64 + 3 * 64 * 96                                          # 34816 matmul parameters
    assert m.mtp_module_params == block + 2 * 64 + 2 * 64 * 64 + 3 * 64         # + norms, projection, 3 norms
    layer = 2 * block + 4 * 32 * 64                                            # 77824 FLOPs per token, s = 32
    assert m.layer_forward_flops_per_token(32) == layer
    assert m.mtp_forward_flops_per_token(32) == layer + 2 * 2 * 64 * 64 + 2 * 64 * 100     # 107008
    assert m.model_flops_per_token(32) == 3 * (2 * layer + 2 * 64 * 100 + 107008)
    # last stage with TP 2: the block (34816/2 + 128 norms), the projection over TP, 3 replicated norms
    assert mtp_params_on_device(m, 2) == 34816 / 2 + 128 + 8192 / 2 + 192
    plain = dataclasses.replace(m, mtp_depth=0)
    _, _, _, last = block_and_edge_params(m, 2, 4, 1)
    _, _, _, last_plain = block_and_edge_params(plain, 2, 4, 1)
    assert last - last_plain == 34816 / 2 + 128 + 8192 / 2 + 192
    # activations, s 32, b 1, t 1: block s·b·h·(8 + 17) + 2·a·s²·b = 51200 + 8192; fp32 logits 4·s·V = 12800;
    # the normed inputs and the projection's input 8·s·h = 16384
    nothing = np.array(0)
    assert mtp_activation_bytes(m, 32, 1, 1, nothing, nothing) == 51200 + 8192 + 12800 + 16384
    assert mtp_activation_bytes(plain, 32, 1, 1, nothing, nothing) == 0.0


def _deepseek_step(model, options=None, dualpipe=1):
    run = MOE_RUNS[0]
    config = dataclasses.replace(run.config, dualpipe=dualpipe)
    return evaluate_config(model, run_cluster(run), run.global_batch, run.seq_len, config, options or run.options())


def test_more_work_next_to_the_head_never_shortens_the_step():
    """With multi-token prediction the DeepSeek-V3 run's last stage (2 blocks + head + MTP) has the most compute
    under 1F1B, while the 5-block middle stage exposes more all-to-all; the step follows the stage whose compute plus
    exposed communication is largest, so adding the module cannot make the step shorter. Under DualPipe the head
    shares rank 0 with the first stage and the fullest middle pair of stages (5 + 4 blocks) sets the pace and the
    bubble: the module lengthens the step (rank 0's exposed communication is part of the step's) but not the
    bubble."""
    ds = PRESETS["deepseek-v3"]
    for dualpipe in (0, 1):
        without = _deepseek_step(dataclasses.replace(ds, mtp_depth=0), dualpipe=dualpipe)
        with_mtp = _deepseek_step(ds, dualpipe=dualpipe)
        assert with_mtp.step_time_s > without.step_time_s
        assert with_mtp.memory_gb["params"] >= without.memory_gb["params"]
        if dualpipe:
            assert with_mtp.time_s["bubble"] == without.time_s["bubble"]
        else:
            assert with_mtp.time_s["bubble"] > without.time_s["bubble"]


def test_fp8_prices_linear_layers_at_fp8_and_the_rest_at_bf16():
    m, dev = TINY_MLA, DEVICES["H100-80GB"]
    one, zero = np.array([1]), np.array([0])
    bf16, fp8 = PlannerOptions(), PlannerOptions(precision="fp8")
    assert (fp8.compute_dtype, fp8.core_dtype, bf16.core_dtype) == ("float8", "bfloat16", "bfloat16")
    t_fwd8, _, t_logits8 = _time_per_layer(m, fp8, dev, 32.0, 1.0, one, zero, zero)
    _, _, t_logits16 = _time_per_layer(m, bf16, dev, 32.0, 1.0, one, zero, zero)
    eta, k, W = fp8.gemm_efficiency, fp8.activation_traffic_factor, dev.memory_bandwidth_Bps
    act = mem.layer_activation_bytes(m, 32.0, 1.0, one, zero, zero)
    core = 32 * 5120                                                           # attention core (no router)
    linear = 32 * 52224 - core
    expected = linear / (1979e12 * eta) + core / (989e12 * eta) + k * act / W
    assert t_fwd8 == pytest.approx(expected, rel=1e-12)
    assert t_logits8 == pytest.approx(t_logits16, rel=1e-12)                   # the output head stays bf16
    moe = dataclasses.replace(TINY_MLA, experts=4, top_k=2, expert_ffn=32)      # the router (2·h·E) stays bf16
    assert moe.router_flops_per_token() == 2 * 64 * 4


def test_deepseek_v3_fp8_keeps_attention_router_and_head_in_bf16(monkeypatch):
    """One DeepSeek-V3 block (b 1, s 4096, TP 1) differs from an all-fp8 pricing by its attention core and router
    FLOPs at 1/989 - 1/1979 s per PFLOP (H800), the output head by its 2·h·V FLOPs per token."""
    ds, dev = PRESETS["deepseek-v3"], DEVICES["H800"]
    one, zero = np.array([1]), np.array([0])
    options = MOE_RUNS[0].options()
    mixed = _time_per_layer(ds, options, dev, 4096.0, 1.0, one, zero, zero)
    monkeypatch.setattr(options_module, "CORE_DTYPES", {})
    all_fp8 = _time_per_layer(ds, options, dev, 4096.0, 1.0, one, zero, zero)
    per_pflop = (1 / 989e12 - 1 / 1979e12) / options.gemm_efficiency
    core = 4096 * (2 * 4096 * 128 * (192 + 128) + 2 * (58 / 61) * 7168 * 256)
    assert mixed[0] - all_fp8[0] == pytest.approx(core * per_pflop, rel=1e-9)
    assert mixed[2] - all_fp8[2] == pytest.approx(4096 * 2 * 7168 * 129280 * per_pflop, rel=1e-9)


def test_mla_fields_from_a_config():
    c = SimpleNamespace(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128)
    assert mla_fields(SimpleNamespace(config=c), 128) == {
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_head_dim": 192, "v_head_dim": 128,
        "kv_heads": 128}
    full_rank = SimpleNamespace(config=SimpleNamespace(**{**vars(c), "q_lora_rank": None}))
    assert mla_fields(full_rank, 128)["q_lora_rank"] == 0
    assert mla_fields(SimpleNamespace(config=SimpleNamespace(hidden_size=64)), 4) == {}
    with pytest.raises(ValueError, match="lacks positive v_head_dim"):
        mla_fields(SimpleNamespace(config=SimpleNamespace(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8)),
                   4)


def test_paddleformers_deepseek_v3_is_read_with_mla():
    from autoparallel.testing import paddleformers_models as pf

    if not pf.available():
        pytest.skip("paddleformers not installed")
    from autoparallel.planner.from_trace import counted_params
    from autoparallel.planner.model_read import read_model

    model = pf.build("deepseek_v3")          # q_lora_rank 32, kv_lora_rank 16, qk 8 + rope 8, v 16, 4 heads of h 64
    spec = read_model(model, 16, "deepseek_v3")
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_head_dim, spec.v_head_dim, spec.qk_rope_head_dim) == \
        (32, 16, 16, 16, 8)
    # q_a 64·32, q_b 32·4·16, kv_a 64·(16 + 8), kv_b 16·4·(8 + 16), o 4·16·64
    assert spec.attention_params == (2048 + 1536 + 4096, 2048 + 1536)
    assert spec.extra_layer_params == 0 and spec.params == counted_params(model)   # the closed form explains all
    assert "kv_lora_rank=16" in spec.source
    full_rank = read_model(pf.build("deepseek_v3", q_lora_rank=None), 16, "deepseek_v3")
    assert full_rank.q_lora_rank == 0 and full_rank.attention_params == (64 * 64 + 1536 + 4096, 1536)


def test_traced_dense_mla_model_matches_the_closed_form():
    """A DeepseekV3 whose blocks are all dense is traced (no routing): the MLA fields come from its config, and the
    closed form's FLOPs per block equal the trace's matmul FLOPs (multi-head attention of width h undercounted them
    by 131072 of 1212416, and left 3120 parameters per block unexplained)."""
    from autoparallel.testing import paddleformers_models as pf

    if not pf.available():
        pytest.skip("paddleformers not installed")
    from autoparallel.planner.model_read import read_model

    spec = read_model(pf.build("deepseek_v3", first_k_dense_replace=2), 16, "deepseek_v3_dense")
    assert spec.source.startswith("traced") and not spec.is_moe
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_head_dim, spec.v_head_dim) == (32, 16, 16, 16)
    assert spec.extra_layer_params == 0
    # s 16, b 1: 16·(2·(q_b 2048 + kv_b 1536 + o 4096 + MLP 3·64·128) + 2·(q_a 2048 + kv_a 1536) + 2·16·4·(16 + 16))
    expected = 16 * (2 * (2048 + 1536 + 4096 + 3 * 64 * 128) + 2 * (2048 + 1536) + 2 * 16 * 4 * 32)
    assert spec.layer_forward_flops_per_token(16) * 16 == spec.traced.layer_matmul_flops == expected


def test_mla_and_mtp_from_a_dimension_string():
    from autoparallel.planner.model_spec import parse_model

    spec = parse_model("hidden=64,layers=2,heads=4,vocab=100,ffn=96,swiglu=1,qk_head_dim=12,v_head_dim=8,"
                       "q_lora_rank=16,kv_lora_rank=8,qk_rope_head_dim=4,mtp_depth=1")
    assert spec == dataclasses.replace(TINY_MLA, name="custom", mtp_depth=1)
    with pytest.raises(ValueError, match="need kv_lora_rank > 0"):
        parse_model("hidden=64,layers=2,heads=4,vocab=100,q_lora_rank=16")
