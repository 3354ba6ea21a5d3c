"""Memory per device: model states by ZeRO stage and offload, activations per Korthikanti et al.

Every function works on numpy arrays (one element per candidate) as well as on scalars, so the
search evaluates thousands of configurations at once with the same formulas a single evaluation uses.
Notation: s sequence, b micro-batch, h hidden, a heads, t TP degree, p PP degree, v virtual stages,
d data-parallel (sharding) degree, Ψ parameters held by one device before ZeRO.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

# recompute codes (index into config.RECOMPUTE)
NONE, SELECTIVE, FULL = 0, 1, 2


def weight_bytes(psi, zero, d, param_bytes):
    """Model weights: param_bytes·Ψ, divided by d under ZeRO-3."""
    return param_bytes * psi / np.where(zero >= 3, d, 1)


def grad_bytes(psi, zero, d, grad_bytes_per_param):
    """Gradients: grad_bytes·Ψ, divided by d under ZeRO-2 and ZeRO-3."""
    return grad_bytes_per_param * psi / np.where(zero >= 2, d, 1)


def optimizer_bytes(psi, zero, d, offload, optimizer_bytes_per_param):
    """Optimizer states (fp32 master, Adam m and v): 12·Ψ (bf16), divided by d under ZeRO-1..3; 0 when offloaded."""
    on_device = optimizer_bytes_per_param * psi / np.where(zero >= 1, d, 1)
    return np.where(offload > 0, 0.0, on_device)


def master_copy_bytes(psi, zero, d, offload, master_bytes=4):
    """The eager runtime's ZeRO stage 1-2 keeps an fp32 master chunk besides the parameter: 4·Ψ/d
    (at stage 3 the chunk is the parameter's only storage, counted as the weight)."""
    return np.where((zero >= 1) & (zero <= 2) & (offload == 0), master_bytes * psi / d, 0.0)


def master_grad_bytes(psi, zero, d, master_bytes=4):
    """The eager runtime's ZeRO stage 1 keeps the full gradient and the master chunk's gradient: + 4·Ψ/d."""
    return np.where(zero == 1, master_bytes * psi / d, 0.0)


def per_tensor_state_bytes(tensors, offload, bytes_per_tensor):
    """Optimizer state held per parameter tensor (AdamW's beta powers: 8 bytes on paddle)."""
    return np.where(offload > 0, 0.0, bytes_per_tensor * np.asarray(tensors, dtype=float))


def host_optimizer_bytes(psi, zero, d, offload, optimizer_bytes_per_param, staging_bytes_per_param=4):
    """Host memory one device uses when offloaded: its optimizer states (fp32 master, Adam m and v) plus the
    pinned fp32 gradient chunk they are updated from (ZeRO-Offload keeps it on the host)."""
    per_param = optimizer_bytes_per_param + staging_bytes_per_param
    return np.where(offload > 0, per_param * psi / np.where(zero >= 1, d, 1), 0.0)


def grad_buffer_bytes(psi, zero, d, m, grad_bytes_per_param, per_micro_batch):
    """Gradients a device holds. ZeRO-0/1: the full buffer. ZeRO-2/3 with one micro-batch: its 1/d chunk.
    ZeRO-2/3 with m > 1 micro-batches: the runtime accumulates the full gradient locally and reduce-scatters
    it once at the last micro-batch (parallel/reducer.py), so it holds the full buffer (ZeRO-1's memory);
    with ``per_micro_batch`` (DeepSpeed-style) it reduce-scatters every micro-batch and holds only the chunk."""
    sharded = (zero >= 2) & ((m <= 1) | per_micro_batch)
    return grad_bytes_per_param * psi / np.where(sharded, d, 1)


def zero3_gather_buffer_bytes(layer_psi, zero, param_bytes):
    """ZeRO-3 working set: the gathered (TP-sharded) weights of two blocks, the current one and the prefetched one."""
    return np.where(zero >= 3, 2.0 * param_bytes * layer_psi, 0.0)


class Storage(NamedTuple):
    """How a run caches a block's activations for backward (the defaults: 16-bit, everything stored, as
    Korthikanti et al. count); DeepSeek-AI 2024 (arXiv:2412.19437) §3.2.3 and §3.3.3 state the other choices."""
    linear_bytes: float = 2.0              # bytes per cached input element of a Linear layer (§3.3.3 FP8: 1)
    attention_output_bytes: float = 2.0    # bytes per element of the input of the Linear after attention (E5M6: 1.5)
    moe_swiglu_recompute: bool = False     # MoE SwiGLU: inputs cached at linear_bytes, output recomputed (§3.3.3 (2))
    norm_up_recompute: bool = False        # RMSNorm and MLA up-projection outputs recomputed, not stored (§3.2.3)


DEFAULT_STORAGE = Storage()


def storage_of(options) -> Storage:
    """The Storage a PlannerOptions states (its linear_input_bytes, attention_output_bytes, moe_swiglu_recompute,
    recompute_norm_up_projection; 0 bytes: the 16-bit default)."""
    linear = options.linear_input_bytes or 2.0
    return Storage(linear, options.attention_output_bytes or linear, bool(options.moe_swiglu_recompute),
                   bool(options.recompute_norm_up_projection))


def activation_coefficients(model, store: Storage = DEFAULT_STORAGE):
    """(sharded, unsharded, score) coefficients of Korthikanti's per-block activation bytes, 16-bit by default.

    sharded (split by TP): Q 2 + K,V 4·kv_dim/h + attention output 2 + MLP (GELU: 4f/h, SwiGLU: 6f/h) -> 24 for GPT;
    unsharded (split only by SP): QKV input 2 + fc1 input 2 + two norm inputs 4 + two dropout masks 2 -> 10 for GPT;
    score bytes per a·s²·b element: softmax 2 + dropout mask 1 + dropout output 2 = 5 (2 without dropout).
    MoE blocks: the MLP term uses the width a token visits ((top_k + shared)·expert_ffn) and each of the top_k
    token copies dispatched to an expert keeps its input (2·top_k, unsharded).
    ``store`` (arXiv:2412.19437): every Linear's cached input (QKV and fc1 inputs, MLA's up-projection inputs, the
    MLP's last matmul's input, the dispatched token copies) at ``linear_bytes``, the attention output at
    ``attention_output_bytes``; a norm's output (the next Linear's input) and MLA's Q, K, V (the up-projections'
    outputs) not stored under ``norm_up_recompute``; the MoE MLP keeps only its SwiGLU inputs at ``linear_bytes``
    under ``moe_swiglu_recompute``. Norm inputs, the attention core's inputs and the activation function's inputs
    stay 16-bit.
    """
    h, lin = model.hidden, store.linear_bytes
    normed = 0.0 if store.norm_up_recompute else lin               # a norm's output is the next Linear's input
    attention, latents = attention_activation_coefficients(model, store)
    sharded = attention + mlp_activation_coefficient(model, store)
    unsharded = 4.0 + 2.0 * normed + latents + (2.0 if model.dropout else 0.0) + lin * model.moe_tokens_fraction()
    score = 5.0 if model.dropout else 2.0
    return sharded, unsharded, score


def mlp_activation_coefficient(model, store: Storage = DEFAULT_STORAGE):
    """Bytes per s·b·h the MLP keeps: the activation function's inputs (SwiGLU: gate and up, 2 per width element;
    GELU: 1) at 2 bytes and its output (the last matmul's input) at ``linear_bytes``: 6f/h (SwiGLU), 4f/h (GELU)
    at 16-bit. The MoE blocks' width ((top_k + shared)·expert_ffn) under ``moe_swiglu_recompute``: only the
    SwiGLU inputs, at ``linear_bytes`` (arXiv:2412.19437 §3.3.3 (2))."""
    act_in = 2.0 if model.swiglu else 1.0
    stored = (2.0 * act_in + store.linear_bytes)
    if not model.is_moe:
        return stored * model.ffn / model.hidden
    f = model.moe_fraction
    moe = act_in * store.linear_bytes if store.moe_swiglu_recompute else stored
    return (stored * (1 - f) * model.ffn + moe * f * (model.top_k + model.shared_experts) * model.expert_ffn) / model.hidden


def attention_activation_coefficients(model, store: Storage = DEFAULT_STORAGE):
    """(sharded, unsharded) bytes per s·b·h the attention keeps besides its input (counted with the norms).

    Multi-head/grouped-query attention: Q 2 + K,V 4·kv_dim/h + attention output 2, nothing unsharded. MLA
    (arXiv:2412.19437 §2.1.1): Q and K of a·d_qk and V and the attention output of a·d_v per token, 2 bytes each,
    split by TP with the heads: 4·a·(d_qk + d_v)/h; the query and key/value latents, each kept twice (its norm's
    input and the up-projection's input), 4·(r_q + r_kv)/h, computed on every TP rank (split only by SP).
    ``store``: the attention output at ``attention_output_bytes``, the up-projections' inputs at ``linear_bytes``;
    under ``norm_up_recompute`` MLA's Q, K, V and the latents' normed copies are not stored (§3.2.3)."""
    h, out = model.hidden, store.attention_output_bytes
    if not model.is_mla:
        return 2.0 + 4.0 * model.kv_dim / h + out, 0.0
    a, r = model.heads, model.latent_norm_params
    qkv = 0.0 if store.norm_up_recompute else 2.0 * a * (2 * model.qk_dim + model.v_dim) / h
    normed = 0.0 if store.norm_up_recompute else store.linear_bytes
    return qkv + out * a * model.v_dim / h, (2.0 + normed) * r / h


def rebuilt_coefficients(model, store: Storage = DEFAULT_STORAGE):
    """(sharded, unsharded) bytes per s·b·h one block rebuilds in backward at 16-bit under ``store``'s
    recomputation: the two normed hidden states 4 and MLA's normed latents 2·(r_q + r_kv)/h (unsharded) and
    Q, K, V 2·a·(2·d_qk + d_v)/h (``norm_up_recompute``); the MoE SwiGLU output 2·(top_k + shared)·expert_ffn/h
    per MoE block (``moe_swiglu_recompute``)."""
    h, sharded, unsharded = model.hidden, 0.0, 0.0
    if store.norm_up_recompute:
        unsharded += 4.0
        if model.is_mla:
            unsharded += 2.0 * model.latent_norm_params / h
            sharded += 2.0 * model.heads * (2 * model.qk_dim + model.v_dim) / h
    if store.moe_swiglu_recompute and model.is_moe:
        sharded += 2.0 * model.moe_fraction * (model.top_k + model.shared_experts) * model.expert_ffn / h
    return sharded, unsharded


def rebuilt_bytes(model, s, b, t, sp, store: Storage = DEFAULT_STORAGE):
    """Bytes one block rebuilds in backward under ``store`` (``rebuilt_coefficients``) per micro-batch: the
    recompute working set they add, and the element-wise traffic their recomputation moves."""
    sharded, unsharded = rebuilt_coefficients(model, store)
    t_sp = np.where(sp > 0, t, 1)
    return s * b * model.hidden * (unsharded / t_sp + sharded / t)


def layer_activation_bytes(model, s, b, t, sp, recompute, scale=1.0, flash_attention=False,
                           store: Storage = DEFAULT_STORAGE):
    """Activation bytes one block keeps for backward, per micro-batch (Korthikanti et al., Table 2).

    none:      s·b·h·(U/t_sp + S/t) + c·a·s²·b/t          GPT, t=1: s·b·h·(34 + 5·a·s/h)
    selective: s·b·h·(U/t_sp + S/t)                      GPT with SP: 34·s·b·h/t
    full:      2·s·b·h/t_sp                              (the block input only)
    with t_sp = t when sequence parallelism is on, else 1; ``scale`` = 2 for fp32 activations; ``store``: how
    the block caches them (``activation_coefficients``).
    """
    sharded, unsharded, score = activation_coefficients(model, store)
    h, a = model.hidden, model.heads
    t_sp = np.where(sp > 0, t, 1)
    sbh = s * b * h
    stored = sbh * (unsharded / t_sp + sharded / t)
    scores = 0.0 if flash_attention else score * a * s * s * b / t
    per_layer = np.where(recompute == FULL, 2.0 * sbh / t_sp,
                         np.where(recompute == SELECTIVE, stored, stored + scores))
    return scale * per_layer


def recompute_working_bytes(model, s, b, t, sp, recompute, scale=1.0, flash_attention=False,
                            store: Storage = DEFAULT_STORAGE):
    """Activations rebuilt while one block runs its backward: a whole block's under full recompute,
    its attention scores under selective recompute, nothing otherwise; plus, unless the whole block is rebuilt,
    what ``store`` recomputes (``rebuilt_bytes``)."""
    full_block = layer_activation_bytes(model, s, b, t, sp, np.zeros_like(recompute), scale, flash_attention, store)
    block_no_scores = layer_activation_bytes(model, s, b, t, sp, np.ones_like(recompute), scale, flash_attention,
                                             store)
    stored = rebuilt_bytes(model, s, b, t, sp, store)
    return np.where(recompute == FULL, full_block,
                    np.where(recompute == SELECTIVE, full_block - block_no_scores, 0.0) + scale * stored)


def in_flight_micro_batches(p, v, m):
    """Micro-batches whose activations the first stage holds at once.

    No pipeline: 1. 1F1B: min(p, m). Interleaved (v virtual stages): min(p, m)·(1 + (p-1)/(p·v))
    (Korthikanti et al. §4.2.3).
    """
    one_f_one_b = np.minimum(p, m).astype(float)
    interleaved = one_f_one_b * (1.0 + (p - 1) / (p * v))
    return np.where(p <= 1, 1.0, np.where(v > 1, interleaved, one_f_one_b))


def logits_bytes(model, s, b, t):
    """fp32 logits kept for the loss on the last stage: 4·s·b·V/t (Korthikanti et al. §4.3)."""
    return 4.0 * s * b * model.vocab / t


def embedding_dropout_bytes(model, s, b, t, sp):
    """Mask of the dropout after the input embedding, one byte per element, kept for every micro-batch in flight on
    the first stage: s·b·h/t with sequence parallelism (the dropout runs on the sequence shard), s·b·h without;
    none for a model without dropout (Korthikanti et al. §4.3: s·b·h·p/t for the p micro-batches in flight;
    Megatron-LM's megatron/training/theoretical_memory_usage.py adds the same term)."""
    t_sp = np.where(sp > 0, t, 1)
    return (1.0 if model.dropout else 0.0) * s * b * model.hidden / t_sp


def head_input_bytes(model, s, b, t, sp, scale=1.0):
    """Inputs the final norm and the output projection keep for backward on the stage holding the head:
    2·s·b·h/t_sp each, 16-bit (Korthikanti et al. §4.3: 4·s·b·h/t with sequence parallelism, besides the
    4·s·b·V/t logits of ``logits_bytes``); ``scale`` = 2 for fp32 activations."""
    t_sp = np.where(sp > 0, t, 1)
    return scale * 4.0 * s * b * model.hidden / t_sp


def reserve_bytes(capacity, fraction):
    """Device memory kept free for the runtime context, communication buffers and fragmentation."""
    return fraction * capacity
