"""DeepSeek-V3's memory choices in the planner, figures by hand.

Sources: DeepSeek-AI 2024 (arXiv:2412.19437) §3.2.1 (DualPipe, Table 2), §3.2.3 ("Recomputation of RMSNorm and MLA
Up-Projection", "Exponential Moving Average in CPU"), §3.3.3 ("Low-Precision Optimizer States", "Low-Precision
Activation"); deepseek-ai/DualPipe example_dualpipe.py (rank r holds stages r and PP-1-r).
"""
import dataclasses

import numpy as np
import pytest

from autoparallel.planner import memory as mem
from autoparallel.planner.cluster import DEVICES
from autoparallel.planner.cost_model import stored_recompute_seconds
from autoparallel.planner.model_spec import PRESETS, ModelSpec
from autoparallel.planner.options import PlannerOptions
from autoparallel.planner.published import MOE_RUNS, predict
from autoparallel.planner import dualpipe
from autoparallel.planner.stage_memory import DUALPIPE_REPLICAS, state_bytes

LLAMA_STYLE = dict(swiglu=True, bias=False, layernorm=False, tied_embeddings=False, learned_positions=False,
                   dropout=False)
# h 64, 4 heads, q/k heads of 12 (8 + rope 4), v heads of 8, r_q 16, r_kv 8, SwiGLU MLP of 96, 2 blocks
TINY_MLA = ModelSpec("mla-tiny", 64, 2, 4, 100, ffn=96, qk_head_dim=12, v_head_dim=8, q_lora_rank=16,
                     kv_lora_rank=8, qk_rope_head_dim=4, **LLAMA_STYLE)
# the same with one dense block and one MoE block: 4 routed experts of width 32, top 2, one shared expert
TINY_MOE = dataclasses.replace(TINY_MLA, name="moe-tiny", experts=4, top_k=2, expert_ffn=32, shared_experts=1,
                               dense_layers=1)
FP8_CACHE = mem.Storage(linear_bytes=1.0, attention_output_bytes=1.5)
ALL = mem.Storage(1.0, 1.5, moe_swiglu_recompute=True, norm_up_recompute=True)


def test_fp8_linear_inputs_and_e5m6_attention_output_by_hand():
    # attention: Q, K 2·a·d_qk and V 2·a·d_v (16-bit) = 2·4·(12 + 12 + 8)/64 = 4; output 1.5·a·d_v/h = 0.75
    # latents: norm input 2 + up-projection input 1 per latent element, (2 + 1)·(16 + 8)/64 = 1.125
    assert mem.attention_activation_coefficients(TINY_MLA, FP8_CACHE) == (4.75, 1.125)
    # MLP: SwiGLU inputs 2·2 + its output (the down matmul's input) 1, times 96/64: 7.5
    # unsharded: norm inputs 4 + QKV and fc1 inputs 1 + 1 + latents 1.125
    assert mem.activation_coefficients(TINY_MLA, FP8_CACHE) == (4.75 + 7.5, 4.0 + 2.0 + 1.125, 2.0)
    # 16-bit storage is the planner's count (Korthikanti et al.): 5 + 9, 8 + 1.5
    assert mem.activation_coefficients(TINY_MLA, mem.DEFAULT_STORAGE) == (5.0 + 9.0, 8.0 + 1.5, 2.0)


def test_norm_and_up_projection_recompute_by_hand():
    # Q, K, V and the normed copies are not stored: attention keeps its output 0.75, latents their norm input
    # 2·24/64 = 0.75, unsharded the two norm inputs 4
    assert mem.activation_coefficients(TINY_MLA, ALL) == (0.75 + 7.5, 4.0 + 0.75, 2.0)
    # rebuilt in backward (16-bit): normed hidden 4 + normed latents 2·24/64 = 0.75; Q, K, V 2·4·32/64 = 4
    assert mem.rebuilt_coefficients(TINY_MLA, ALL) == (4.0, 4.75)
    nothing = np.array(0)
    s, b, sbh = 32.0, 1.0, 32 * 64
    stored = mem.layer_activation_bytes(TINY_MLA, s, b, np.array(1), nothing, nothing, 1.0, True, ALL)
    assert stored == (8.25 + 4.75) * sbh                                     # 26624
    working = mem.recompute_working_bytes(TINY_MLA, s, b, np.array(1), nothing, nothing, 1.0, True, ALL)
    assert working == (4.0 + 4.75) * sbh                                     # 17920
    assert mem.recompute_working_bytes(TINY_MLA, s, b, np.array(1), nothing, nothing, 1.0, True) == 0.0


def test_moe_swiglu_inputs_cached_and_output_recomputed_by_hand():
    # one dense block (f 0.5): SwiGLU inputs 4 + output 1 per width element, 5·0.5·96 = 240; one MoE block: the
    # SwiGLU inputs only, 2·1 per element of (2 + 1)·32, 2·0.5·96 = 96 -> (240 + 96)/64 = 5.25
    assert mem.mlp_activation_coefficient(TINY_MOE, ALL) == 5.25
    assert mem.mlp_activation_coefficient(TINY_MOE, FP8_CACHE) == (240 + 5 * 0.5 * 96) / 64       # 7.5
    # the dispatched token copies (top 2 on half the blocks) at 1 byte: 1.0 unsharded
    assert mem.activation_coefficients(TINY_MOE, ALL)[1] == 4.0 + 0.75 + 1.0
    # the rebuilt SwiGLU output, 16-bit: 2·0.5·96/64 = 1.5
    assert mem.rebuilt_coefficients(TINY_MOE, ALL) == (4.0 + 1.5, 4.75)


def test_recompute_time_by_hand():
    dev, o = DEVICES["H800"], PlannerOptions(precision="fp8", recompute_norm_up_projection=True)
    # up-projections: q_b 16·4·12 = 768, kv_b 8·4·(12 - 4 + 8) = 512
    assert TINY_MLA.up_projection_params == 1280
    flops, rebuilt = 2 * 32 * 1280, (4.0 + 4.75) * 32 * 64
    expected = flops / (dev.flops("float8") * o.gemm_efficiency) + o.activation_traffic_factor * rebuilt / dev.memory_bandwidth_Bps
    got = stored_recompute_seconds(TINY_MLA, o, dev, 32.0, 1.0, np.array(1), np.array(0))
    assert got == pytest.approx(expected, rel=1e-12)
    assert stored_recompute_seconds(TINY_MLA, PlannerOptions(precision="fp8"), dev, 32.0, 1.0, np.array(1),
                                    np.array(0)) == 0.0


def test_bf16_adam_moments_by_hand():
    # fp32 master 4 + two BF16 moments 2 + 2 = 8 (bf16/fp8); fp32 training: 2 + 2 = 4; defaults 12 and 8
    assert PlannerOptions(precision="fp8", optimizer_moment_bytes=2.0).optimizer_bytes == 8.0
    assert PlannerOptions(precision="fp32", optimizer_moment_bytes=2.0).optimizer_bytes == 4.0
    assert (PlannerOptions().optimizer_bytes, PlannerOptions(precision="fp32").optimizer_bytes) == (12, 8)
    o = PlannerOptions(precision="fp8", optimizer_moment_bytes=2.0)
    one, zero = np.array(1), np.array(0)
    st = state_bytes(o, 1000.0, 0.0, one, np.array(4), np.array(1), 1.0, zero, 0)
    assert (st["params"], st["grads"], st["optimizer"]) == (2000.0, 4000.0, 8 * 1000 / 4)


def test_dualpipe_memory_by_hand():
    """Rank r holds stages r and PP-1-r; stage r keeps PP - r micro-batches in flight, stage PP-1-r r + 1."""
    # 8 stages of 3, 4, 4, 5, 4, 4, 4, 2 blocks: rank 0 stages 0 and 7, rank 1 stages 1 and 6, ...
    loads = dualpipe.rank_loads([3, 4, 4, 5, 4, 4, 4, 2])
    assert loads == ((3 + 2, 3 * 8 + 2 * 1), (4 + 4, 4 * 7 + 4 * 2), (4 + 4, 4 * 6 + 4 * 3), (5 + 4, 5 * 5 + 4 * 4))
    # PP + 1 stage-micro-batches per rank with equal stages (Table 2), against 1F1B's PP on stage 0
    assert all(flight == 4 * (8 + 1) for _, flight in dualpipe.rank_loads([4] * 8))
    o = PlannerOptions()
    one = np.array(1)
    # every stage on 2·dp ranks: ZeRO-1 over dp = 4 shards the optimizer states over 8
    st = state_bytes(o, 1000.0, 0.0, one, DUALPIPE_REPLICAS * np.array(4), one, 1.0, np.array(0), 0)
    assert (st["params"], st["grads"], st["optimizer"]) == (2000.0, 4000.0, 12 * 1000 / 8)


def test_storage_options_refuse_bad_input():
    with pytest.raises(ValueError, match="linear_input_bytes .* must be in \\[0, 2\\], got 3"):
        PlannerOptions(linear_input_bytes=3)
    with pytest.raises(ValueError, match="optimizer_moment_bytes must be in \\(0, 4\\], got 0"):
        PlannerOptions(optimizer_moment_bytes=0)
    with pytest.raises(ValueError, match="need precision bf16 or fp8, got 'fp32'"):
        PlannerOptions(precision="fp32", recompute_norm_up_projection=True)


def test_deepseek_v3_run_memory_by_hand():
    """The published run's fullest device under DualPipe (ranks 2 and 13: the 5-block stage 2 with 14 micro-batches
    in flight and the 4-block stage 13 with 3), every stated choice written out per block: s·b·h = 4096·7168, MoE
    share f = 58/61."""
    run, ds = MOE_RUNS[0], PRESETS["deepseek-v3"]
    h, f = 7168, 58 / 61
    attention = 1.5 * 128 * 128 / h                                  # E5M6 output; Q, K, V recomputed
    latents = 2.0 * (1536 + 512) / h                                  # the latents' norm inputs
    mlp = (5.0 * (1 - f) * 18432 + 2.0 * f * 9 * 2048) / h            # dense: 4 + 1; MoE: SwiGLU inputs in FP8
    unsharded = 4.0 + latents + 8 * f                                 # norm inputs, latents, FP8 token copies
    rebuilt = 4.0 + latents + 2 * 128 * (2 * 192 + 128) / h + 2.0 * f * 9 * 2048 / h
    sbh = 4096 * 7168
    per_block = (attention + mlp + unsharded) * sbh
    expected = (5 * 14 + 4 * 3) * per_block + rebuilt * sbh           # 82 block-micro-batches in flight
    cand = predict(run)
    assert cand.memory_gb["activations"] == pytest.approx(expected / 1e9, rel=1e-9)
    plain = predict(dataclasses.replace(run, software=(("flash_attention", True), ("moe_a2a_overlap", True)),
                                        config=dataclasses.replace(run.config, dualpipe=0)))
    # plain 1F1B's fullest stage is the 5-block one; the DualPipe rank holds 5 + 4 blocks' weights and gradients,
    # and their optimizer states over 2·dp (ZeRO-1; BF16 moments: 8 of the optimizer's 12 bytes)
    assert cand.memory_gb["params"] == pytest.approx(9 / 5 * plain.memory_gb["params"], rel=1e-12)
    assert cand.memory_gb["grads"] == pytest.approx(9 / 5 * plain.memory_gb["grads"], rel=1e-12)
    assert cand.memory_gb["optimizer"] == pytest.approx(0.5 * 9 / 5 * plain.memory_gb["optimizer"] * 8 / 12,
                                                        rel=1e-12)
    assert cand.memory_per_device_gb == pytest.approx(sum(cand.memory_gb.values()), rel=1e-12)
    assert cand.memory_per_device_gb > cand.capacity_gb and not cand.feasible
