"""Step time and memory of a parallel configuration: each formula once, named, vectorised.

``evaluate`` prices a batch of configurations (numpy arrays, one element per candidate) with the
formulas below; a single configuration is a batch of one, so the search and ``--fixed`` share code.

Step time on the slowest pipeline stage (the last: it also runs the output head):

    step = m·t_mb + bubble + pp_comm + dp_comm_exposed + optimizer
    t_mb = compute + recompute + tp_comm + zero3_gather_exposed       (one micro-batch, one stage)
    bubble = (p-1)/v · t_mb                                           (1F1B: v = 1)
    compute of a block = matmul FLOPs / (peak·gemm_efficiency) + element-wise bytes / memory bandwidth

TP collectives sit on the critical path; DP gradient sync and ZeRO gathers hide behind compute by
``cluster.overlap``; stage-to-stage sends are exposed. Collective times come from
``autoparallel.comm.cost.collective_seconds`` over the link the group uses (``cluster.link_for``).
Ranks are laid out tp-innermost, then dp, then pp (Megatron's order), so TP stays inside a node when
tp <= devices_per_node. A calibrated profile's measured fit for a collective and group size replaces the
link formula (``affine_seconds``); a profile with eager-runtime costs (``cluster.runtime``: CPU ranks)
prices per-op overheads and the runtime's own collectives instead (planner/eager_cost.py) as the
``overhead`` term and in the communication terms.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from autoparallel.comm.cost import collective_seconds
from autoparallel.planner import eager_cost
from autoparallel.planner import memory as mem
from autoparallel.planner.memory import FULL, SELECTIVE

GRID_KEYS = ("dp", "tp", "pp", "vpp", "sp", "zero", "recompute", "offload", "mb")

# ---------------------------------------------------------------------------------------------
# collectives over arrays
# ---------------------------------------------------------------------------------------------
_PROBE_BYTES = float(2 ** 30)


@lru_cache(maxsize=4096)
def _affine(collective: str, n: int, latency_s: float, bandwidth_Bps: float, backend: str):
    """collective_seconds is affine in the bytes b: (latency seconds, seconds per byte) for this group."""
    base = collective_seconds(collective, 0.0, n, latency_s, bandwidth_Bps, backend)
    probe = collective_seconds(collective, _PROBE_BYTES, n, latency_s, bandwidth_Bps, backend)
    return base, (probe - base) / _PROBE_BYTES


def affine_seconds(cluster, collective: str, n: int, ranks):
    """(seconds, seconds per byte) of ``collective`` over the group ``ranks`` of ``n`` members: the
    cluster's measured fit for (collective, n) when it has one, else the link's alpha-beta formula."""
    fit = cluster.collective_fit(collective, n) if cluster.collectives else None
    if fit is not None:
        return fit.latency_s, 1.0 / fit.bandwidth_Bps
    link = cluster.link_for(ranks)
    return _affine(collective, n, link.latency_s, link.bandwidth_Bps, cluster.backend)


def _links(tp, dp):
    """Rank lists of candidate i's TP group, DP group and next-stage peer (layout: tp, then dp, then pp)."""
    tp = np.asarray(tp).reshape(-1)
    dp = np.asarray(dp).reshape(-1)
    tp_ranks = lambda i: range(int(tp[i]))                                    # noqa: E731
    dp_ranks = lambda i: range(0, int(tp[i]) * int(dp[i]), int(tp[i]))        # noqa: E731
    pp_ranks = lambda i: (0, int(tp[i]) * int(dp[i]))                         # noqa: E731
    return tp_ranks, dp_ranks, pp_ranks


def _unique_seconds(cluster, collective, b, n, ranks_of, key_arrays):
    """Seconds of ``collective`` of ``b`` bytes per rank over groups of ``n`` ranks (arrays).

    The group's link is ``cluster.link_for(ranks_of(i))``; each distinct key (e.g. (tp, dp)) is priced
    once with comm.cost.collective_seconds, then applied to every candidate's byte count.
    """
    keys = np.stack([np.asarray(k).reshape(-1) for k in key_arrays], axis=1)
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    n_arr = np.broadcast_to(np.asarray(n), inverse.shape)
    c0 = np.zeros(len(first))
    c1 = np.zeros(len(first))
    for j, i in enumerate(first):
        size = int(n_arr[i])
        if size <= 1:
            continue
        c0[j], c1[j] = affine_seconds(cluster, collective, size, ranks_of(int(i)))
    b = np.broadcast_to(np.asarray(b, dtype=float), inverse.shape)
    return c0[inverse] + c1[inverse] * b


# ---------------------------------------------------------------------------------------------
# named time formulas
# ---------------------------------------------------------------------------------------------
def roofline_seconds(flops, traffic_bytes, peak_flops, gemm_efficiency, memory_bandwidth_Bps):
    """Additive roofline: matmuls at gemm_efficiency·peak plus element-wise traffic at memory bandwidth."""
    return flops / (peak_flops * gemm_efficiency) + traffic_bytes / memory_bandwidth_Bps


def layer_forward_flops(model, s, b, t):
    """One block's forward FLOPs on one TP rank: b·s·(2·P_mm + 4·s·h)/t."""
    return b * model.layer_forward_flops_per_token(s) * s / t


def attention_core_flops(model, s, b, t):
    """Attention scores and their product with V on one TP rank: 4·b·s²·h/t."""
    return b * model.attention_core_flops_per_token(s) * s / t


def logits_forward_flops(model, s, b, t):
    """Output projection on one TP rank: 2·b·s·h·V/t."""
    return b * s * model.logits_forward_flops_per_token() / t


def tp_collectives_per_layer(recompute):
    """All-reduces per block and micro-batch: 2 forward + 2 backward, + 2 when the forward is recomputed.

    With sequence parallelism each becomes an all-gather plus a reduce-scatter (Korthikanti et al. §4.2.2).
    """
    return 4 + 2 * (recompute == FULL)


def pipeline_bubble_fraction(p, v, m):
    """Idle fraction of a pipeline with equal stages: (p-1)/(m+p-1) for 1F1B/FThenB, (p-1)/(v·m+p-1) interleaved."""
    return (p - 1) / (v * m + p - 1)


def pipeline_bubble_seconds(p, v, t_mb):
    """Bubble time of one step: (p-1)/v micro-batch times (so step = (m + (p-1)/v)·t_mb)."""
    return (p - 1) / v * t_mb


def pp_sends_per_step(p, v, m):
    """Stage-to-stage messages on the critical path: 2·(v·m + p - 1) (one forward, one backward per chunk)."""
    return np.where(p > 1, 2 * (v * m + p - 1), 0)


def exposed_seconds(comm_s, window_s, overlap):
    """Communication left on the critical path when ``overlap`` of it can hide behind ``window_s`` of compute."""
    return comm_s - overlap * np.minimum(comm_s, window_s)


def optimizer_traffic_bytes(shard_params, options):
    """Adam update traffic on device: read the grad, read and write the states, write the weight."""
    return shard_params * (options.grad_bytes + 2 * options.optimizer_bytes + options.param_bytes)


def offload_seconds(shard_params, options):
    """ZeRO-Offload: grads down and weights up over the host link, plus the Adam update on host cores."""
    transfer = shard_params * (options.grad_bytes + options.param_bytes) / options.host_link_bandwidth_Bps
    return transfer + shard_params / options.host_adam_params_per_s


# ---------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------
def stage_params(model, t, p):
    """(Ψ of the first stage, Ψ of the last stage, Ψ of one block) on one device, before ZeRO.

    Blocks split evenly (a stage holds ceil(l/p)); TP splits the matmuls, the column-parallel biases and
    the vocabulary; the first stage holds the embedding, the last the output head (a tied head is a copy
    when p > 1).
    """
    h, V = model.hidden, model.vocab
    layers_per_stage = -(-model.layers // p)
    col_bias = model.layer_column_bias_params
    layer_psi = (model.layer_matmul_params + col_bias) / t + model.layer_other_params - col_bias
    emb = V * h / t + model.position_params
    norm = model.head_params - (0 if model.tied_embeddings else V * h)
    head_untied = 0.0 if model.tied_embeddings else V * h / t
    body = layers_per_stage * layer_psi
    first = np.where(p == 1, body + emb + head_untied + norm, body + emb)
    last = np.where(p == 1, first, body + V * h / t + norm)
    return first, last, layer_psi


def evaluate(model, cluster, global_batch, seq_len, grid, options):
    """Price every configuration of ``grid`` (dict of equal-length int arrays keyed by GRID_KEYS).

    Returns a dict of arrays: time terms (seconds per step), memory terms (bytes per device on the
    stage that needs most), step_time, tokens_per_s, tflops_per_device, mfu, feasible.
    """
    g = {k: np.asarray(grid[k]).reshape(-1) for k in GRID_KEYS}
    dp, tp, pp, v, sp = g["dp"], g["tp"], g["pp"], g["vpp"], g["sp"]
    zero, rc, off, b = g["zero"], g["recompute"], g["offload"], g["mb"].astype(float)
    s = float(seq_len)
    B = float(global_batch)
    m = B / (dp * b)
    o = options
    scale = o.activation_scale
    dev = cluster.device
    peak = dev.flops(o.compute_dtype)
    W = dev.memory_bandwidth_Bps
    eta, k = o.gemm_efficiency, o.activation_traffic_factor
    world = dp * tp * pp
    layers_per_stage = -(-model.layers // pp)

    # ---- compute on one micro-batch ------------------------------------------------------------
    none_code = np.zeros_like(rc)
    act_layer_full = mem.layer_activation_bytes(model, s, b, tp, sp, none_code, scale, o.flash_attention)
    act_scores = act_layer_full - mem.layer_activation_bytes(model, s, b, tp, sp, none_code + SELECTIVE, scale,
                                                             o.flash_attention)
    t_fwd_layer = roofline_seconds(layer_forward_flops(model, s, b, tp), k * act_layer_full, peak, eta, W)
    t_attn_core = roofline_seconds(attention_core_flops(model, s, b, tp), k * act_scores, peak, eta, W)
    t_recompute_layer = np.where(rc == FULL, t_fwd_layer, np.where(rc == SELECTIVE, t_attn_core, 0.0))
    t_logits_fwd = roofline_seconds(logits_forward_flops(model, s, b, tp),
                                    k * mem.logits_bytes(model, s, b, tp), peak, eta, W)
    compute_mb = layers_per_stage * 3.0 * t_fwd_layer + 3.0 * t_logits_fwd
    recompute_mb = layers_per_stage * t_recompute_layer

    # ---- tensor parallelism ----------------------------------------------------------------------
    tp_ranks, dp_ranks, pp_ranks = _links(tp, dp)
    msg = scale * 2.0 * b * s * model.hidden                     # one block boundary activation, all of it
    ar = _unique_seconds(cluster, "all_reduce", msg, tp, tp_ranks, (tp,))
    ag = _unique_seconds(cluster, "all_gather", msg / tp, tp, tp_ranks, (tp,))
    rs = _unique_seconds(cluster, "reduce_scatter", msg, tp, tp_ranks, (tp,))
    tp_layer = tp_collectives_per_layer(rc) * np.where(sp > 0, ag + rs, ar)
    tp_mb = np.where(tp > 1, layers_per_stage * tp_layer, 0.0)

    # ---- data parallelism and ZeRO -------------------------------------------------------------
    psi_first, psi_last, layer_psi = stage_params(model, tp, pp)
    psi = np.maximum(psi_first, psi_last)
    grads = o.grad_bytes * psi
    dp_ar = _unique_seconds(cluster, "all_reduce", grads, dp, dp_ranks, (tp, dp))
    dp_rs = _unique_seconds(cluster, "reduce_scatter", grads, dp, dp_ranks, (tp, dp))
    dp_ag = _unique_seconds(cluster, "all_gather", o.param_bytes * psi / dp, dp, dp_ranks, (tp, dp))
    layer_ag = _unique_seconds(cluster, "all_gather", o.param_bytes * layer_psi / dp, dp, dp_ranks, (tp, dp))
    grad_sync = np.where(dp > 1, np.where(zero == 0, dp_ar, dp_rs), 0.0)
    param_sync = np.where((dp > 1) & (zero >= 1) & (zero <= 2), dp_ag, 0.0)
    zero3_gathers_mb = np.where((dp > 1) & (zero >= 3),
                                layers_per_stage * (2 + (rc == FULL)) * layer_ag, 0.0)
    zero3_exposed_mb = exposed_seconds(zero3_gathers_mb, compute_mb + recompute_mb, cluster.overlap)

    backward_mb = layers_per_stage * (2.0 * t_fwd_layer + t_recompute_layer) + 2.0 * t_logits_fwd
    forward_mb = layers_per_stage * t_fwd_layer + t_logits_fwd
    dp_exposed = (exposed_seconds(grad_sync, backward_mb, cluster.overlap)
                  + exposed_seconds(param_sync, forward_mb, cluster.overlap))

    # ---- eager runtime on CPU ranks (a calibrated profile): per-op overheads, the runtime's collectives ----
    overhead_mb = np.zeros_like(compute_mb)
    eager = None
    if cluster.runtime is not None:
        eager = eager_cost.eager_terms(model, cluster, g, m, layers_per_stage, psi, msg, b, s)
        overhead_mb, tp_mb, zero3_exposed_mb = eager["overhead_mb"], eager["tp_mb"], eager["zero3_mb"]
        dp_exposed = m * eager["dp_mb"] + eager["dp_step"]
    t_mb = compute_mb + recompute_mb + tp_mb + zero3_exposed_mb + overhead_mb

    # ---- pipeline ----------------------------------------------------------------------------------
    p2p_msg = np.where((sp > 0) | o.pp_scatter_gather, msg / tp, msg)
    p2p = _unique_seconds(cluster, "send_recv", p2p_msg, np.where(pp > 1, 2, 1), pp_ranks, (tp, dp, pp))
    pp_comm = pp_sends_per_step(pp, v, m) * p2p
    bubble = np.where(pp > 1, pipeline_bubble_seconds(pp, v, t_mb), 0.0)

    # ---- optimizer ---------------------------------------------------------------------------------
    shard = psi / np.where(zero >= 1, dp, 1)
    optimizer = np.where(off > 0, offload_seconds(shard, o), optimizer_traffic_bytes(shard, o) / W)
    if eager is not None:
        optimizer = optimizer + eager["optimizer"]

    step = m * t_mb + bubble + pp_comm + dp_exposed + optimizer

    # ---- memory ------------------------------------------------------------------------------------
    inflight = mem.in_flight_micro_batches(pp, v, m)
    working = mem.recompute_working_bytes(model, s, b, tp, sp, rc, scale, o.flash_attention)
    act_layer = mem.layer_activation_bytes(model, s, b, tp, sp, rc, scale, o.flash_attention)
    logits = mem.logits_bytes(model, s, b, tp)
    z3buf = mem.zero3_gather_buffer_bytes(layer_psi, zero, o.param_bytes)

    tensors = eager_cost.tensors_on_stage(model.op_profile(), layers_per_stage)

    def stage_memory(psi_stage, activations):
        grads = mem.grad_bytes(psi_stage, zero, dp, o.grad_bytes)
        states = mem.optimizer_bytes(psi_stage, zero, dp, off, o.optimizer_bytes)
        if o.zero_master_copy:
            grads = grads + mem.master_grad_bytes(psi_stage, zero, dp)
            states = states + mem.master_copy_bytes(psi_stage, zero, dp, off)
        return {"params": mem.weight_bytes(psi_stage, zero, dp, o.param_bytes),
                "grads": grads,
                "optimizer": states + mem.per_tensor_state_bytes(tensors, off, o.optimizer_tensor_bytes),
                "activations": activations,
                "zero3_buffer": z3buf}

    first = stage_memory(psi_first, layers_per_stage * act_layer * inflight + working
                         + np.where(pp == 1, logits, 0.0))
    last = stage_memory(psi_last, layers_per_stage * act_layer + working + logits)
    first_total = sum(first.values())
    last_total = sum(last.values())
    use_first = first_total >= last_total
    memory = {key: np.where(use_first, first[key], last[key]) for key in first}
    reserve = mem.reserve_bytes(dev.memory_bytes, o.memory_reserve_fraction)
    memory["reserve"] = np.full(step.shape, reserve)
    total = np.maximum(first_total, last_total) + reserve
    host = mem.host_optimizer_bytes(np.where(use_first, psi_first, psi_last), zero, dp, off, o.optimizer_bytes)

    # ---- throughput ----------------------------------------------------------------------------------
    hw_per_token = np.array([model.hardware_flops_per_token(seq_len, r) for r in ("none", "selective", "full")])
    tokens = B * s
    model_flops = model.model_flops_per_token(seq_len) * tokens
    hardware_flops = hw_per_token[rc] * tokens
    return {
        "num_micro_batches": m,
        "step_time_s": step,
        "compute_s": m * compute_mb,
        "recompute_s": m * recompute_mb,
        "tp_comm_s": m * tp_mb,
        "zero3_gather_s": m * zero3_exposed_mb,
        "bubble_s": bubble,
        "pp_comm_s": pp_comm,
        "dp_comm_s": dp_exposed,
        "optimizer_s": optimizer,
        "overhead_s": m * overhead_mb,
        "memory": memory,
        "memory_total": total,
        "host_bytes": host,
        "feasible": total <= dev.memory_bytes,
        "tokens_per_s": tokens / step,
        "tflops_per_device": hardware_flops / (step * world) / 1e12,
        "mfu": model_flops / (step * world * peak),
    }


TIME_TERMS = ("compute_s", "recompute_s", "tp_comm_s", "zero3_gather_s", "bubble_s", "pp_comm_s", "dp_comm_s",
              "optimizer_s", "overhead_s")
MEMORY_TERMS = ("params", "grads", "optimizer", "activations", "zero3_buffer", "reserve")
