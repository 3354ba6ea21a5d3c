"""FP8's quantization passes in the planner (planner/fp8.py), figures by hand.

Source: DeepSeek-AI 2024 (arXiv:2412.19437) §3.5.2: online quantization reads BF16 activations from HBM and writes
the FP8 values back (2 + 1 B per element); the backward reads the cached FP8 input, transposes and re-quantizes it
(1 + 1 B per element).
"""
import dataclasses

import numpy as np
import pytest

from autoparallel.planner import fp8
from autoparallel.planner.cluster import preset
from autoparallel.planner.config import ParallelConfig
from autoparallel.planner.model_spec import ModelSpec
from autoparallel.planner.options import PlannerOptions
from autoparallel.planner.search import evaluate_config

LLAMA_STYLE = dict(swiglu=True, bias=False, layernorm=False, tied_embeddings=False, learned_positions=False,
                   dropout=False)
# h 64, 4 heads of 16, 2 key/value heads, SwiGLU MLP of 96, 3 blocks
GQA = ModelSpec("gqa-tiny", 64, 3, 4, 100, ffn=96, kv_heads=2, **LLAMA_STYLE)
# MLA: q/k heads of 12 (8 + rope 4), v heads of 8, r_q 16, r_kv 8
MLA = ModelSpec("mla-tiny", 64, 2, 4, 100, ffn=96, qk_head_dim=12, v_head_dim=8, q_lora_rank=16, kv_lora_rank=8,
                qk_rope_head_dim=4, **LLAMA_STYLE)
# one dense block and one MoE block: top 2 of 4 experts of width 32, one shared expert
MOE = dataclasses.replace(MLA, name="moe-tiny", experts=4, top_k=2, expert_ffn=32, shared_experts=1, dense_layers=1)


def test_gemm_elements_by_hand():
    # GQA: q, k, v read the normed input once (64) and the output projection's output gradient is whole (64);
    # split: the output projection's input 4·16 = 64, the q, k, v outputs 64 + 2·(16 + 16) = 128
    assert fp8.attention_elements(GQA) == ((64, 64), (64, 128))
    # MLA: whole inputs h + r_q + r_kv = 88, whole outputs r_q + r_kv + rope + h = 92; split: the output
    # projection's input 4·8 = 32, q_b's output 4·12 = 48 and kv_b's 4·(12 - 4 + 8) = 64
    assert fp8.attention_elements(MLA) == ((88, 92), (32, 112))
    # SwiGLU of 96: the input and the output gradient whole (64, 64), split the down input 96 and gate/up 192
    assert fp8.mlp_elements(GQA) == ((64, 64), (96.0, 192.0))
    # MoE averaged with the dense block: width (96 + 3·32)/2 = 96
    assert fp8.mlp_elements(MOE) == ((64, 64), (96.0, 192.0))
    assert fp8.mlp_elements(dataclasses.replace(MOE, top_k=1)) == ((64, 64), (80.0, 160.0))


def test_quantization_bytes_by_hand():
    s, b = 32.0, 2.0
    # tp 1: inputs 64 + 64 + 64 + 96 = 288, outputs 64 + 64 + 128 + 192 = 448 per token
    fwd, bwd = fp8.quantization_bytes(GQA, s, b, np.array([1]), np.array([0]))
    assert (fwd[0], bwd[0]) == (64 * 3.0 * 288, 64 * (2.0 * 288 + 3.0 * 448))
    # tp 2 without SP: whole parts stay (128 in, 128 out), split parts halve (160 -> 80, 320 -> 160)
    fwd, bwd = fp8.quantization_bytes(GQA, s, b, np.array([2]), np.array([0]))
    assert (fwd[0], bwd[0]) == (64 * 3.0 * 208, 64 * (2.0 * 208 + 3.0 * 288))
    # with SP the whole parts are split too
    fwd, bwd = fp8.quantization_bytes(GQA, s, b, np.array([2]), np.array([1]))
    assert (fwd[0], bwd[0]) == (64 * 3.0 * 144, 64 * (2.0 * 144 + 3.0 * 224))


def test_only_fp8_pays_and_the_step_carries_it(monkeypatch):
    """bf16 has no quantization; under fp8 a step's compute grows by blocks x micro-batches x the passes' bytes over
    the memory bandwidth (the same step with the passes' bytes set to zero is the reference)."""
    cluster, config = preset("H800", 1, 1), ParallelConfig(dp=1)
    dev = cluster.device
    zero = fp8.quantization_seconds(GQA, PlannerOptions(), dev, 32.0, 1.0, np.array([1]), np.array([0]))
    assert [float(x) for x in zero] == [0.0, 0.0]
    o = PlannerOptions(precision="fp8")
    with_passes = evaluate_config(GQA, cluster, 4, 32, config, o)
    monkeypatch.setattr(fp8, "ONLINE_BYTES", 0.0)
    monkeypatch.setattr(fp8, "TRANSPOSE_BYTES", 0.0)
    without = evaluate_config(GQA, cluster, 4, 32, config, o)
    per_block = 32 * (3.0 * 288 + 2.0 * 288 + 3.0 * 448) / dev.memory_bandwidth_Bps
    # 3 blocks, 4 micro-batches of 1 sequence
    assert with_passes.time_s["compute"] - without.time_s["compute"] == pytest.approx(3 * 4 * per_block, rel=1e-9)
    assert with_passes.step_time_s > without.step_time_s


# ---- fine-grained FP8 GEMMs at DeepGEMM's measured H800 rates (planner/fp8.py) -------------------------------------
def test_linear_gemms_by_hand():
    # MLA: fused down-projection N = r_q + r_kv + rope = 28 on K = h; q_b 4·12 on r_q; kv_b 4·(8 + 8) on r_kv;
    # o on 4·8
    att = [(28, 64, 1.0, "normal"), (48, 16, 1.0, "normal"), (64, 8, 1.0, "normal"), (64, 32, 1.0, "normal")]
    assert fp8.linear_gemms(MLA)[:4] == att
    # MOE: one dense block of two (gate/up 192 x 64, down 64 x 96), routed experts top 2 (grouped), one shared
    assert fp8.linear_gemms(MOE)[4:] == [(192, 64, 0.5, "normal"), (64, 96, 0.5, "normal"),
                                         (64, 64, 1.0, "grouped"), (64, 32, 1.0, "grouped"),
                                         (64, 64, 0.5, "normal"), (64, 32, 0.5, "normal")]
    # GQA: q, k, v fused N = 4·16 + 2·2·16 = 128 on h; o 64 on 64; the MLP of every block
    assert fp8.linear_gemms(GQA) == [(128, 64, 1.0, "normal"), (64, 64, 1.0, "normal"),
                                     (192, 64, 1.0, "normal"), (64, 96, 1.0, "normal")]


def test_measured_efficiency_is_the_flop_weighted_harmonic_mean():
    # two shapes measured: (128, 64) at 100 and (64, 64) at 50; (192, 64) takes the nearest, K 64 then N 128 -> 100;
    # (64, 96) takes K 64's nearest N: 64 -> 50
    table = {"normal": {(128, 64): 100.0, (64, 64): 50.0}}
    flops = [2 * 128 * 64, 2 * 64 * 64, 2 * 192 * 64, 2 * 64 * 96]
    seconds = flops[0] / 100 + flops[1] / 50 + flops[2] / 100 + flops[3] / 50
    assert fp8.measured_efficiency(GQA, table, 200.0) == pytest.approx(sum(flops) / seconds / 200.0)


def test_deepseek_v3_runs_at_deepgemm_rates():
    """DeepSeek-V3's shapes are DeepGEMM's table rows but the dense MLP's: its linear GEMMs sustain 60% of the
    H800's fp8 peak (the calibrated bf16 efficiency is 66.1%); the published run prices them so, every other run
    keeps gemm_efficiency, and the option slows exactly the linear layers' GEMMs."""
    from autoparallel.planner import published
    from autoparallel.planner.model_spec import PRESETS

    v3 = PRESETS["deepseek-v3"]
    shapes = {(n, k) for n, k, _, kind in fp8.linear_gemms(v3) if kind == "normal"}
    assert shapes - set(fp8.DEEPGEMM_H800["normal"]) == {(36864, 7168), (7168, 18432)}     # the 3 dense blocks' MLP
    eff = fp8.measured_efficiency(v3, fp8.DEEPGEMM_H800, 1979e12)
    assert 0.59 < eff < 0.61
    run = published.MOE_RUNS[0]
    assert run.options().linear_gemm_efficiency == eff
    assert all(r.options().linear_gemm_efficiency == 0 for r in published.RUNS)
    assert PlannerOptions().linear_efficiency == PlannerOptions().gemm_efficiency
    with pytest.raises(ValueError, match="linear_gemm_efficiency"):
        PlannerOptions(linear_gemm_efficiency=1.5)


def test_linear_efficiency_scales_the_linear_gemms_only():
    """A bf16 dense block on one device: halving the linear layers' efficiency adds exactly their GEMM seconds
    (FLOPs minus the attention core's, over peak·η) to each forward; the attention core is unchanged."""
    from autoparallel.planner import cost_model as cm

    dev = preset("H800", 1, 1).device
    o = PlannerOptions(flash_attention=True)
    s, b, one, zero = 32.0, 2.0, np.array([1]), np.array([0])
    flops, attn_core, core = cm.block_flops(GQA, o, s, b, one, zero)
    t_fwd = cm._time_per_layer(GQA, o, dev, s, b, one, zero, zero)[0]
    slow = o.replace(linear_gemm_efficiency=o.gemm_efficiency / 2)
    t_slow = cm._time_per_layer(GQA, slow, dev, s, b, one, zero, zero)[0]
    linear = (flops - core) / (dev.flops("bfloat16") * o.gemm_efficiency)
    assert t_slow[0] - t_fwd[0] == pytest.approx(linear[0])
    w = cm.weight_grad_seconds(GQA, slow, dev, s, b, one, zero) - cm.weight_grad_seconds(GQA, o, dev, s, b, one, zero)
    assert w[0] == pytest.approx(linear[0])
