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
