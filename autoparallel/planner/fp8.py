"""FP8 training's quantization passes: the element-wise traffic fine-grained FP8 GEMMs add to a block.

Source: DeepSeek-AI 2024 (arXiv:2412.19437). §3.3.2 quantizes activations online in 1x128 tiles (weights in
128x128 blocks) and §3.5.2 states how that runs on the H800:
- "Support for Online Quantization ... we have to read 128 BF16 activation values (the output of the previous
  computation) from HBM (High Bandwidth Memory) for quantization, and the quantized FP8 values are then written back
  to HBM, only to be read again for MMA": per element 2 B read + 1 B written (``ONLINE_BYTES``);
- "Support for Transposed GEMM Operations ... activations during the forward pass are quantized into 1x128 FP8 tiles
  and stored. During the backward pass, the matrix needs to be read out, dequantized, transposed, re-quantized into
  128x1 tiles, and stored in HBM": per element 1 B read + 1 B written (``TRANSPOSE_BYTES``).

Counted per FP8 GEMM: its input quantized online in the forward and re-quantized transposed in the backward, and its
output gradient quantized online in the backward. Not counted: a transposed copy of the output gradient (not stated),
the per-tile scaling factors (one fp32 per 128 elements, under 3% of these bytes), the weights' 128x128 quantization
(once per step, not per token). The router, the attention core and the output head stay BF16 (§3.3.1) and add none.
"""
from __future__ import annotations

import numpy as np

ONLINE_BYTES = 3.0       # read 2 B (BF16) + write 1 B (FP8) per element
TRANSPOSE_BYTES = 2.0    # read 1 B + write 1 B per element


def attention_elements(model) -> tuple:
    """(inputs, outputs) per token of the attention's FP8 GEMMs, as ((whole on every TP rank), (split by TP)):
    column-parallel inputs and row-parallel outputs are whole, the others split; MLA's down-projections (replicated
    weights) are whole. The normed hidden state feeds q, k and v (or MLA's down-projections) and is quantized once."""
    h, a, kv, dqk, dv = model.hidden, model.heads, model.kv_heads, model.qk_dim, model.v_dim
    if not model.is_mla:
        return (h, h), (a * dv, a * dqk + kv * (dqk + dv))
    r_q, r_kv, rope = model.q_lora_rank, model.kv_lora_rank, model.qk_rope_head_dim
    split = (a * dv, a * dqk + a * (dqk - rope + dv))            # the output's input; q(_b) and kv_b outputs
    return (h + r_q + r_kv, r_q + r_kv + rope + h), split


def mlp_elements(model) -> tuple:
    """(inputs, outputs) per token of the MLP's FP8 GEMMs as ((whole), (split by TP)), averaged over dense and MoE
    blocks. A MoE block's input is quantized once, before dispatch, for its routed and shared experts, and its output
    gradient once, before the backward dispatch (§3.3.3); each expert a token reaches quantizes its own inner
    activations (routed experts' tokens spread evenly over the expert-parallel ranks)."""
    h, up = model.hidden, model.mlp_matrices - 1
    width = model.active_ffn                  # ffn, or (top_k + shared)·expert_ffn on MoE blocks, averaged
    return (h, h), (width, up * width)


def quantization_bytes(model, s, b, tp, sp) -> tuple:
    """(forward, backward) bytes of quantization traffic of one block for one micro-batch on one TP rank: forward
    ONLINE·inputs, backward TRANSPOSE·inputs + ONLINE·outputs (the whole parts split only by SP)."""
    (att_whole, att_split), (mlp_whole, mlp_split) = attention_elements(model), mlp_elements(model)
    t_sp = np.where(sp > 0, tp, 1)
    inputs = (att_whole[0] + mlp_whole[0]) / t_sp + (att_split[0] + mlp_split[0]) / tp
    outputs = (att_whole[1] + mlp_whole[1]) / t_sp + (att_split[1] + mlp_split[1]) / tp
    tokens = b * s
    return tokens * ONLINE_BYTES * inputs, tokens * (TRANSPOSE_BYTES * inputs + ONLINE_BYTES * outputs)


def quantization_seconds(model, o, dev, s, b, tp, sp) -> tuple:
    """(forward, backward) seconds of the quantization passes at the device's memory bandwidth; zeros unless the
    linear layers run in FP8 (``PlannerOptions.precision == "fp8"``)."""
    if o.precision != "fp8":
        zero = np.zeros(np.shape(tp))
        return zero, zero
    fwd, bwd = quantization_bytes(model, s, b, tp, sp)
    return fwd / dev.memory_bandwidth_Bps, bwd / dev.memory_bandwidth_Bps


# ---- fine-grained FP8 GEMMs at a measured rate ------------------------------------------------------------------
# DeepGEMM (deepseek-ai/DeepGEMM, README of its first release, February 2025): "FP8 General Matrix Multiplications
# (GEMMs) with fine-grained scaling, as proposed in DeepSeek-V3", promoting partial sums on the CUDA cores (§3.3.2's
# scheme); its announcement names it the kernels of V3/R1 training and inference. TFLOP/s it measured "on H800 with
# NVCC 12.8" at "all shapes potentially used in DeepSeek-V3/R1" without tensor parallelism, for M = 4096 rows, keyed by
# (N, K): "Normal GEMMs for dense models", and "Grouped GEMMs for MoE models (contiguous layout)" ("for training
# forward passes"), 4 groups of 8192 rows (4 experts per device: 256 routed experts over EP 64).
DEEPGEMM_H800 = {
    "normal": {(2112, 7168): 1058e12, (24576, 1536): 990e12, (32768, 512): 590e12, (7168, 16384): 1358e12,
               (4096, 7168): 1304e12, (7168, 2048): 1025e12},
    "grouped": {(4096, 7168): 1297e12, (7168, 2048): 1099e12},
}


def linear_gemms(model) -> list:
    """The linear layers' GEMMs of the model's blocks as (N, K, per token and block (averaged over the dense and
    MoE blocks), kind): MLA's fused q/kv down-projection, q and kv up-projections and output projection (or q, k, v
    and o without MLA); a dense block's MLP; a MoE block's routed experts (``top_k`` grouped GEMMs) and shared
    experts (normal GEMMs)."""
    h, a, up = model.hidden, model.heads, model.mlp_matrices - 1
    if model.is_mla:
        nope = model.qk_dim - model.qk_rope_head_dim
        att = [(model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim, h),
               (a * model.qk_dim, model.q_lora_rank), (a * (nope + model.v_dim), model.kv_lora_rank),
               (h, a * model.v_dim)]
    else:
        att = [(a * model.qk_dim + model.kv_heads * (model.qk_dim + model.v_dim), h), (h, a * model.v_dim)]
    out = [(n, k, 1.0, "normal") for n, k in att]
    moe = model.moe_fraction
    if moe < 1:
        out += [(up * model.ffn, h, 1.0 - moe, "normal"), (h, model.ffn, 1.0 - moe, "normal")]
    if moe > 0:
        e = model.expert_ffn
        out += [(up * e, h, moe * model.top_k, "grouped"), (h, e, moe * model.top_k, "grouped")]
        if model.shared_experts:
            out += [(up * e, h, moe * model.shared_experts, "normal"), (h, e, moe * model.shared_experts, "normal")]
    return out


def _rate(table: dict, n: int, k: int) -> float:
    """The measured rate of (n, k), else of the nearest measured shape (K first, then N, on a log scale)."""
    if (n, k) in table:
        return table[(n, k)]
    near = min(table, key=lambda nk: (abs(np.log(nk[1] / k)), abs(np.log(nk[0] / n))))
    return table[near]


def measured_efficiency(model, table: dict, peak_flops: float) -> float:
    """The linear layers' GEMMs at ``table``'s measured rates, as one fraction of ``peak_flops``: their FLOPs over
    the seconds each class takes at its rate (a FLOP-weighted harmonic mean). The backward's data- and
    weight-gradient GEMMs are taken at their forward GEMM's rate (the table has forward shapes only)."""
    flops = seconds = 0.0
    for n, k, count, kind in linear_gemms(model):
        f = 2.0 * n * k * count
        flops, seconds = flops + f, seconds + f / _rate(table[kind], n, k)
    return flops / seconds / peak_flops
