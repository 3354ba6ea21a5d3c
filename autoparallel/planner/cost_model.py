"""Step time and memory of a parallel configuration: each formula once, named, vectorised.

``evaluate`` prices a batch of configurations (numpy arrays, one element per candidate) with the
formulas below; a single configuration is a batch of one, so the search and ``--fixed`` share code.

Step time on the slowest pipeline stage (stage i holds n_i blocks, planner/stages.py):

    step = m·t_max + bubble + pp_comm + exposed overlappable comm + ZeRO-1/2 parameter gathers + optimizer
    T_L  = 3·t_fwd + t_recompute + TP collectives (+ expert all-to-all)      (one block, one micro-batch)
    t_i  = n_i·T_L (+ the output head on the last stage),  t_max = max_i t_i
    bubble = (Σ_i t_i − t_max) / v                                          ((p-1)/v·t for equal stages)
    DualPipe: a device's t is the mean of its two stages' (r and p-1-r), bubble (p/2-1)(F&B + B - 3W) of the
    slowest device's chunk (planner/dualpipe.py; W: ``weight_grad_seconds``)
    t_fwd of a block = matmul FLOPs / (peak·gemm_efficiency) + element-wise bytes / memory bandwidth

TP collectives, pipeline sends and (unless overlapped) expert all-to-alls sit on the critical path; ZeRO-3
gathers and the gradient sync hide behind compute only within each link's budget (planner/links.py).
Collectives are priced on the links they use (NVLink, network) by comm/cost.py's hierarchical model over the
cluster's topology (planner/topology.py). Ranks are laid out tp-innermost, then expert/data, then pp
(Megatron's order), so TP stays inside a node when tp <= devices_per_node. A calibrated profile's measured
fit for a collective and group size replaces the link formula (``affine_seconds``); a profile with
eager-runtime costs (``cluster.runtime``: CPU ranks) prices per-op overheads and the runtime's own
collectives instead (planner/eager_cost.py) as the ``overhead`` term and in the communication terms.
Parameters per block and stage are in planner/params.py, blocks per stage in planner/stages.py, and the memory
of the stage that needs most (with the search's pruning bounds) in planner/stage_memory.py.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np

from autoparallel.core.cost import collective_seconds
from autoparallel.planner import dualpipe, eager_cost, fp8
from autoparallel.planner import memory as mem
from autoparallel.planner.links import Stream, exposed_overlap
from autoparallel.planner.memory import FULL, SELECTIVE
from autoparallel.planner.params import (block_and_edge_params, edge_params, largest_stage_params,  # noqa: F401
                                         layer_params_on_device, stage_params)
from autoparallel.planner.stage_memory import memory_floors, stage_memory  # noqa: F401
from autoparallel.planner.stages import pair_layout, stage_layout
from autoparallel.core.topology import topology_of

GRID_KEYS = ("dp", "tp", "pp", "vpp", "sp", "zero", "recompute", "offload", "mb", "ep", "split", "dualpipe")

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


# ---------------------------------------------------------------------------------------------
# named time formulas
# ---------------------------------------------------------------------------------------------
def roofline_seconds(flops, traffic_bytes, peak_flops, gemm_efficiency, memory_bandwidth_Bps):
    """Additive roofline: matmuls at gemm_efficiency·peak plus element-wise traffic at memory bandwidth."""
    return flops / (peak_flops * gemm_efficiency) + traffic_bytes / memory_bandwidth_Bps


def two_rate_seconds(flops, core_flops, traffic_bytes, peak_flops, core_peak_flops, gemm_efficiency,
                     memory_bandwidth_Bps, linear_efficiency=None):
    """Roofline with two GEMM classes: the linear layers' FLOPs (``flops - core_flops``) at ``peak_flops`` and
    ``linear_efficiency`` (default gemm_efficiency), the attention core's and router's (``core_flops``) at
    ``core_peak_flops`` (the bf16 peak under fp8, options.CORE_DTYPES) and gemm_efficiency; plus element-wise
    traffic at memory bandwidth."""
    linear = gemm_efficiency if linear_efficiency is None else linear_efficiency
    return (roofline_seconds(flops - core_flops, traffic_bytes, peak_flops, linear, memory_bandwidth_Bps)
            + core_flops / (core_peak_flops * gemm_efficiency))


def compute_share(cluster, comm_sm_fraction):
    """The cluster as its compute sees it when communication kernels hold ``comm_sm_fraction`` of each device's SMs
    all step (``PlannerOptions.comm_sm_fraction``): every matmul peak scales by (1 - comm_sm_fraction). Memory
    bandwidth is left whole (fewer SMs still reach it; the source gives no figure for it)."""
    if not comm_sm_fraction:
        return cluster
    dev = cluster.device
    peaks = tuple((dtype, rate * (1.0 - comm_sm_fraction)) for dtype, rate in dev.peak_flops)
    return dataclasses.replace(cluster, device=dataclasses.replace(dev, peak_flops=peaks))


def layer_forward_flops(model, s, b, t, t_sp=1):
    """One block's forward FLOPs on one TP rank: b·s·(2·P_mm + 4·s·h)/t; MLA's down-projections (replicated
    weights, autoparallel/parallel/tp_plans.py MLA_PLAN) run on every rank's tokens, split only by SP (t_sp)."""
    replicated = model.layer_replicated_flops_per_token()
    return b * s * ((model.layer_forward_flops_per_token(s) - replicated) / t + replicated / t_sp)


def attention_core_flops(model, s, b, t):
    """Attention scores and their product with V on one TP rank: 4·b·s²·h/t."""
    return b * model.attention_core_flops_per_token(s) * s / t


def logits_forward_flops(model, s, b, t):
    """Output projection on one TP rank: 2·b·s·h·V/t."""
    return b * s * model.logits_forward_flops_per_token() / t


def tp_collectives_per_layer(recompute, parallel_block=False):
    """All-reduces per block and micro-batch: 2 forward + 2 backward, + the forward's again when it is recomputed.

    A parallel block (attention and MLP side by side, GPT-J / GPT-NeoX) sums both branches' row-parallel outputs
    before one forward all-reduce; its backward keeps two, one per branch's column-parallel input
    (EleutherAI/gpt-neox ``ParallelTransformerLayer`` with ``gpt_j_residual``: ``parallel_output`` row-parallel
    layers, then ``reduce_from_model_parallel_region`` of the sum). With sequence parallelism each all-reduce becomes
    an all-gather plus a reduce-scatter (Korthikanti et al. §4.2.2); the evaluation keeps the sequential count there.
    """
    forward = np.where(parallel_block, 1, 2)
    return forward + 2 + forward * (recompute == FULL)


def pipeline_bubble_fraction(p, v, m):
    """Idle fraction of a pipeline with equal stages: (p-1)/(m+p-1) for 1F1B/FThenB, (p-1)/(v·m+p-1) interleaved."""
    return (p - 1) / (v * m + p - 1)


def pipeline_bubble_seconds(p, v, t_mb):
    """Bubble time of one step: (p-1)/v micro-batch times (so step = (m + (p-1)/v)·t_mb)."""
    return (p - 1) / v * t_mb


def pp_sends_per_step(p, v, m, serial=False):
    """Stage-to-stage messages on the critical path: 2·(v·m + p - 1) (one forward, one backward per chunk).

    ``serial``: an interior stage (p > 2) exchanges with both neighbours in every step, one blocking transfer after
    the other (DeepSpeed's TrainSchedule: SendGrad then RecvActivation in a forward step, RecvGrad then
    SendActivation in a backward step), so 4·(m + p - 1) transfers sit on its timeline."""
    per_step = np.where(serial & (p > 2), 2, 1)
    return np.where(p > 1, 2 * (v * m + p - 1) * per_step, 0)


def optimizer_traffic_bytes(shard_params, options):
    """Adam update traffic on device: read the grad, read and write the states, write the weight."""
    return shard_params * (options.grad_bytes + 2 * options.optimizer_bytes + options.param_bytes)


def offload_seconds(shard_params, options, pcie_Bps):
    """ZeRO-Offload: grads down and weights up over the host link (PCIe), plus the Adam update on host cores.
    Returns (seconds, PCIe busy seconds)."""
    bw = options.host_link_bandwidth_Bps or pcie_Bps
    transfer = shard_params * (options.grad_bytes + options.param_bytes) / bw
    return transfer + shard_params / options.host_adam_params_per_s, transfer


# ---------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------
def routed_all_to_all(cluster, model, nbytes, ep, tp, calls, cache=None):
    """Expert dispatch/combine over the EP group (ranks ``tp`` apart). Without a routing limit a token's top_k
    copies leave the node with probability (n-g)/n each; with node-limited routing (``route_nodes`` R) a token
    crosses the network once per remote node it reaches, at most min(R, top_k) times, and is fanned out over
    NVLink inside the node; on a rail-optimised fabric the copies first cross NVLink to the right rail (PXN)."""
    stream = Stream.of(cluster, "all_to_all", nbytes, ep, tp, calls=calls, pxn=True, where=ep > 1, cache=cache)
    if not model.route_nodes:
        return stream
    gpn = cluster.devices_per_node
    g = np.where(tp >= gpn, 1, np.minimum(ep, np.maximum(gpn // tp, 1)))
    k = -(-ep // g)
    flat = np.where(ep > g, (ep - g) / np.maximum(ep, 1), 1.0)
    limited = min(model.route_nodes, model.top_k) / model.top_k * np.where(k > 1, (k - 1) / k, 0.0)
    return stream.with_network(np.where(ep > g, np.minimum(1.0, limited / flat), 1.0))


def stored_recompute_seconds(model, o, dev, s, b, tp, sp):
    """Seconds one block spends in backward rebuilding what the run's storage choices do not keep
    (memory.rebuilt_bytes): MLA's up-projections again, 2·b·s·(r_q·a·d_qk + r_kv·a·(d_qk - d_rope + d_v))/t FLOPs
    at the linear layers' peak (``recompute_norm_up_projection``, arXiv:2412.19437 §3.2.3), and the rebuilt
    tensors' element-wise traffic (the norms, the MoE SwiGLU output) at memory bandwidth, as the forward's."""
    store = mem.storage_of(o)
    up = model.up_projection_params if (store.norm_up_recompute and model.is_mla) else 0.0
    traffic = o.activation_traffic_factor * mem.rebuilt_bytes(model, s, b, tp, sp, store)
    return roofline_seconds(2.0 * b * s * up / tp, traffic, dev.flops(o.compute_dtype), o.linear_efficiency,
                            dev.memory_bandwidth_Bps)


def block_flops(model, o, s, b, tp, sp):
    """One block's forward GEMM FLOPs on one TP rank for one micro-batch, routed experts at the busiest rank's
    pace (``moe_imbalance``): (all of them, the attention core's, the core dtype's: attention core + router)."""
    imbalance = 2.0 * model.moe_fraction * model.top_k * model.expert_params * (o.moe_imbalance - 1.0)
    flops = layer_forward_flops(model, s, b, tp, np.where(sp > 0, tp, 1)) + b * s * imbalance / tp
    attn_core = attention_core_flops(model, s, b, tp)
    return flops, attn_core, attn_core + b * s * model.router_flops_per_token() / tp


def weight_grad_seconds(model, o, dev, s, b, tp, sp):
    """W, one block's "backward for weights" (arXiv:2412.19437 Table 2) on one TP rank for one micro-batch: a layer
    with weights computes in backward a data gradient and a weight gradient, each a GEMM of its forward's FLOPs, so
    W = (linear layers' forward FLOPs) / (peak·η) + (router's) / (core peak·η); the attention core, norms and
    activations have no weights and no W."""
    flops, attn_core, core = block_flops(model, o, s, b, tp, sp)
    return ((flops - core) / (dev.flops(o.compute_dtype) * o.linear_efficiency)
            + (core - attn_core) / (dev.flops(o.core_dtype) * o.gemm_efficiency))


def logits_weight_grad_seconds(model, o, dev, s, b, tp):
    """W of the output head: its weight-gradient GEMM, the forward's FLOPs 2·b·s·h·V/t at the core dtype's peak."""
    return logits_forward_flops(model, s, b, tp) / (dev.flops(o.core_dtype) * o.gemm_efficiency)


def _time_per_layer(model, o, dev, s, b, tp, sp, rc):
    """(forward, recompute, output-head forward) seconds on one TP rank for one micro-batch; routed experts run
    at the busiest rank's pace (``moe_imbalance``); the attention core, router and output head at the core dtype's
    peak (bf16 under fp8), the linear layers at the compute dtype's."""
    peak, W, eta, k = dev.flops(o.compute_dtype), dev.memory_bandwidth_Bps, o.gemm_efficiency, o.activation_traffic_factor
    core_peak = dev.flops(o.core_dtype)
    scale = o.activation_scale
    none_code = np.zeros_like(rc)
    act_full = mem.layer_activation_bytes(model, s, b, tp, sp, none_code, scale, o.flash_attention)
    act_scores = act_full - mem.layer_activation_bytes(model, s, b, tp, sp, none_code + SELECTIVE, scale,
                                                       o.flash_attention)
    flops, attn_core, core = block_flops(model, o, s, b, tp, sp)
    t_fwd = two_rate_seconds(flops, core, k * act_full, peak, core_peak, eta, W, o.linear_efficiency)
    t_core = roofline_seconds(attn_core, k * act_scores, core_peak, eta, W)
    t_rc = np.where(rc == FULL, t_fwd, np.where(rc == SELECTIVE, t_core, 0.0) + stored_recompute_seconds(
        model, o, dev, s, b, tp, sp))
    t_logits = roofline_seconds(logits_forward_flops(model, s, b, tp), k * mem.logits_bytes(model, s, b, tp),
                                core_peak, eta, W)
    return t_fwd, t_rc, t_logits


def _block_seconds(model, o, cluster, s, b, tp, sp, rc, ep, cache):
    """One block of ``model`` for one micro-batch: (t_fwd, t_rc, t_logits, TP stream, expert all-to-all stream,
    T_L = 3·t_fwd + t_rc + FP8 quantization + TP collectives (+ the all-to-all unless overlapped), F_L its forward:
    t_fwd + the forward's quantization and collectives, W_L its weight gradients: ``weight_grad_seconds``, t_q the
    FP8 quantization passes, forward and backward: planner/fp8.py)."""
    t_fwd, t_rc, t_logits = _time_per_layer(model, o, cluster.device, s, b, tp, sp, rc)
    q_fwd, q_bwd = fp8.quantization_seconds(model, o, cluster.device, s, b, tp, sp)
    msg = o.activation_scale * 2.0 * b * s * model.hidden            # one block boundary activation
    ar = Stream.of(cluster, "all_reduce", msg, tp, 1, cache=cache)
    sp_pair = (Stream.of(cluster, "all_gather", msg / tp, tp, 1, cache=cache)
               + Stream.of(cluster, "reduce_scatter", msg, tp, 1, cache=cache))
    tp_calls = tp_collectives_per_layer(rc, (sp == 0) & bool(model.parallel_block))
    tp_layer = Stream.select(sp > 0, sp_pair, ar).scaled(np.where(tp > 1, tp_calls, 0.0))
    a2a_bytes = o.activation_scale * 2.0 * b * s * model.hidden * model.top_k / tp
    a2a_calls = model.moe_fraction * (4 + 2 * (rc == FULL))
    a2a_layer = routed_all_to_all(cluster, model, a2a_bytes, ep, tp, a2a_calls, cache)
    a2a_exposed = 0.0 if o.moe_a2a_overlap else a2a_layer.seconds
    T_L = 3.0 * t_fwd + q_fwd + q_bwd + t_rc + tp_layer.seconds + a2a_exposed
    forward = np.where((sp == 0) & bool(model.parallel_block), 1, 2)        # the forward's share of the calls
    F_L = t_fwd + q_fwd + tp_layer.seconds * forward / tp_calls + a2a_exposed * 2.0 / (4.0 + 2.0 * (rc == FULL))
    W_L = weight_grad_seconds(model, o, cluster.device, s, b, tp, sp)
    return t_fwd, t_rc, t_logits, tp_layer, a2a_layer, T_L, F_L, W_L, q_fwd + q_bwd


def mtp_seconds(model, o, cluster, s, b, tp, sp, rc, ep, t_logits, cache):
    """Forward + backward seconds per micro-batch of the multi-token-prediction modules on the last stage
    (planner/mtp.py; DeepSeek-AI 2024 §2.2), and their block's (TP, all-to-all) streams: each module its block
    (``ModelSpec.mtp_block``, priced as any block), the 2h x h projection split by TP (a linear-layer GEMM) and a
    second output-head pass. Returns (seconds, forward compute seconds, backward compute seconds, weight-gradient
    seconds, streams): the compute seconds widen the last stage's windows that overlapped communication hides
    behind; the weight gradients are DualPipe's W (the block's, the projection's and the head pass's GEMMs). Zeros
    and no streams without multi-token prediction."""
    if not model.mtp_depth:
        return 0.0, 0.0, 0.0, 0.0, ()
    t_fwd, t_rc, _, tp_m, a2a_m, T_m, _, W_m, _ = _block_seconds(model.mtp_block(), o, cluster, s, b, tp, sp, rc,
                                                                 ep, cache)
    dev = cluster.device
    proj = roofline_seconds(2.0 * b * s * model.mtp_projection_params / tp, 0.0, dev.flops(o.compute_dtype),
                            o.linear_efficiency, dev.memory_bandwidth_Bps)
    d = model.mtp_depth
    W = d * (W_m + proj + logits_weight_grad_seconds(model, o, dev, s, b, tp))
    return (d * (T_m + 3.0 * proj + 3.0 * t_logits), d * (t_fwd + proj + t_logits),
            d * (2.0 * t_fwd + t_rc + 2.0 * proj + 2.0 * t_logits), W, (tp_m, a2a_m))


def evaluate(model, cluster, global_batch, seq_len, grid, options):
    """Price every configuration of ``grid`` (dict of equal-length int arrays keyed by GRID_KEYS).

    Returns a dict of arrays: time terms (seconds per step), memory terms (bytes per device on the
    stage that needs most), host memory, each link's busy seconds, step_time, tokens_per_s,
    tflops_per_device, mfu, feasible.
    """
    full_peak = cluster.device.flops(options.compute_dtype)          # MFU's denominator: the whole device
    cluster = compute_share(cluster, options.comm_sm_fraction)
    n = len(np.asarray(grid["dp"]).reshape(-1))
    g = {k: np.asarray(grid[k]).reshape(-1) if k in grid else np.full(n, 1 if k == "ep" else 0) for k in GRID_KEYS}
    dp, tp, pp, v, sp, ep = g["dp"], g["tp"], g["pp"], g["vpp"], g["sp"], g["ep"]
    zero, rc, off, b = g["zero"], g["recompute"], g["offload"], g["mb"].astype(float)
    s, B, o, dev = float(seq_len), float(global_batch), options, cluster.device
    m = B / (dp * b)
    W = dev.memory_bandwidth_Bps
    world = dp * tp * pp
    gpn = cluster.devices_per_node
    eager = cluster.runtime is not None
    dual = (g["dualpipe"] > 0) & (pp > 1)
    if eager and dual.any():
        raise NotImplementedError("DualPipe is not priced for the eager runtime's calibrated profile (its blocking "
                                  "collectives and per-op costs follow the runtime's 1F1B)")
    split = np.where(eager, 0, g["split"])
    n_first, n_last, n_mid = stage_layout(model, seq_len, pp, v, split)
    n_max = np.maximum(np.maximum(n_first, n_last), n_mid)

    cache = {}                                   # group shapes of this evaluation, priced once per array pair
    tp_ep, tp_dp, pp_peers = tp * ep, tp * dp, np.where(pp > 1, 2, 1)

    # ---- one block, one micro-batch ------------------------------------------------------------------
    t_fwd, t_rc, t_logits, tp_layer, a2a_layer, T_L, F_L, W_L, t_q = _block_seconds(model, o, cluster, s, b, tp, sp, rc,
                                                                               ep, cache)
    msg = o.activation_scale * 2.0 * b * s * model.hidden            # one block boundary activation
    a2a_hidden = bool(o.moe_a2a_overlap)
    mtp_s, mtp_fwd, mtp_bwd, mtp_W, mtp_streams = mtp_seconds(model, o, cluster, s, b, tp, sp, rc, ep, t_logits,
                                                              cache)
    H = 3.0 * t_logits + mtp_s
    H_F, H_W = t_logits + mtp_fwd, logits_weight_grad_seconds(model, o, dev, s, b, tp) + mtp_W

    # ---- pipeline stages: the slowest sets the pace, the others fill and drain the bubble ------------
    t_first = n_first * T_L + np.where(pp == 1, H, 0.0)
    t_last = n_last * T_L + H
    t_mid = n_mid * T_L
    t_max = np.maximum(np.maximum(t_first, t_last), t_mid)
    bubble = np.where(pp > 1, (model.layers * T_L + H - t_max) / v, 0.0)

    # ---- parameters per stage ----------------------------------------------------------------------
    layer_dense, layer_expert, edge_first, edge_last = block_and_edge_params(model, tp, pp, ep)
    dense_psi = largest_stage_params(n_first, n_last, n_mid, layer_dense, edge_first, edge_last)
    expert_psi = n_max * layer_expert
    d_e = np.maximum(dp // np.maximum(ep, 1), 1)
    # DualPipe: rank r holds stages r and PP-1-r (planner/dualpipe.py), so every stage lives on 2·dp ranks: a rank's
    # gradients, ZeRO shards and optimizer step cover its two stages, reduced over its dp group and then with its
    # partner (deepseek-ai/DualPipe example_dualpipe.py sums the two copies' gradients); ZeRO shards over 2·dp
    pairs = pair_layout(model, seq_len, pp, split) if dual.any() else (np.zeros(n), np.zeros(n))
    dense_psi = np.where(dual, np.maximum(pairs[0] * layer_dense + edge_first + edge_last, pairs[1] * layer_dense),
                         dense_psi)
    expert_psi = np.where(dual, np.maximum(pairs[0], pairs[1]) * layer_expert, expert_psi)
    replicas = np.where(dual, 2, 1)                  # copies of a stage per data-parallel replica
    partner_stride = np.maximum(world // 2, 1)       # the partner priced half the world away (r vs PP-1-r)

    # ---- data parallelism and ZeRO: streams on links -----------------------------------------------
    gb, pb = o.grad_bytes, o.param_bytes
    per_mb = (zero >= 2) & (m > 1) & bool(o.zero_grad_per_micro_batch)
    sync_calls = np.where(per_mb, 0.0, 1.0)
    mb_calls = np.where(per_mb, m, 0.0)
    coll = np.where(zero == 0, 0, 1)                 # 0: all_reduce, 1: reduce_scatter

    def grad_stream(psi, group, stride, calls):
        """Gradient reduction in buckets of ``o.grad_bucket_bytes``: each bucket pays the collective's latency."""
        buckets = np.maximum(1.0, np.ceil(gb * psi / o.grad_bucket_bytes))
        each = gb * psi / buckets
        a = Stream.of(cluster, "all_reduce", each, group, stride, calls=calls * buckets,
                      where=(group > 1) & (coll == 0), cache=cache)
        r = Stream.of(cluster, "reduce_scatter", each, group, stride, calls=calls * buckets,
                      where=(group > 1) & (coll == 1), cache=cache)
        return a + r

    f = model.trainable_fraction                     # frozen parameters: no gradient, no ZeRO-1/2 re-gather
    def dp_grads(calls):
        """The gradient reduction over the data-parallel group, then (DualPipe) of its 1/dp part with the partner."""
        return (grad_stream(f * dense_psi, dp, tp, calls) + grad_stream(f * expert_psi, d_e, tp_ep, calls)
                + grad_stream(f * dense_psi / dp, replicas, partner_stride, calls)
                + grad_stream(f * expert_psi / d_e, replicas, partner_stride, calls))

    def dp_gather(psi, group, stride, calls, where):
        """All-gather of a ZeRO-sharded ``psi``: from the partner (DualPipe, shards of psi/(2·group)), then over the
        data-parallel group."""
        return (Stream.of(cluster, "all_gather", pb * psi / (replicas * group), replicas, partner_stride,
                          calls=calls, where=where & (replicas > 1), cache=cache)
                + Stream.of(cluster, "all_gather", pb * psi / group, group, stride, calls=calls,
                            where=where & (group > 1), cache=cache))

    sync = dp_grads(sync_calls)
    rs_each_mb = dp_grads(mb_calls)
    z12 = (zero >= 1) & (zero <= 2)
    param_gather = dp_gather(f * dense_psi, dp, tp, 1.0, z12) + dp_gather(f * expert_psi, d_e, tp_ep, 1.0, z12)
    z3 = zero >= 3
    layer_gather = (dp_gather(layer_dense, dp, tp, m * n_max, z3)
                    + dp_gather(layer_expert, d_e, tp_ep, m * n_max, z3))
    z3_bwd = layer_gather.scaled(1 + (rc == FULL))                  # backward re-gathers (and recompute's)

    def stage_overlap(n_k, head_k):
        """Overlappable communication a stage of n_k blocks (and the head when head_k) leaves exposed: its own
        compute windows and its own blocks' all-to-alls (the gradient sync and ZeRO gathers as priced above)."""
        w_fwd = m * (n_k * t_fwd + head_k * (t_logits + mtp_fwd))
        w_bwd = m * (n_k * (2.0 * t_fwd + t_rc) + head_k * (2.0 * t_logits + mtp_bwd))
        a2a_fwd, a2a_bwd = Stream.zero(n), Stream.zero(n)
        if a2a_hidden:                    # dispatch/combine overlapped with another micro-batch's compute
            share = 2.0 / (4.0 + 2.0 * (rc == FULL))
            a2a_fwd = a2a_layer.scaled(m * n_k * share)
            a2a_bwd = a2a_layer.scaled(m * n_k * (1.0 - share))
            if mtp_streams:               # the multi-token-prediction block's, next to the head
                a2a_mtp = mtp_streams[1]
                a2a_fwd = a2a_fwd + a2a_mtp.scaled(m * head_k * model.mtp_depth * share)
                a2a_bwd = a2a_bwd + a2a_mtp.scaled(m * head_k * model.mtp_depth * (1.0 - share))
        w_last = w_bwd / m if o.grad_sync_overlap else np.zeros(n)
        return exposed_overlap(layer_gather + a2a_fwd, z3_bwd + rs_each_mb + a2a_bwd, sync, w_fwd, w_bwd, w_last,
                               cluster.overlap)

    # the step follows the stage whose compute plus exposed communication is largest (first, last, middle; a stage
    # that does not exist -- no last one without a pipeline, no middle one below three stages -- never does).
    # DualPipe: the rows are devices, rank 0 (stages 0 and p-1) and the fullest other rank (planner/dualpipe.py)
    blocks, heads, live = dualpipe.device_blocks(*pairs, pp, dual, n_first, n_last, n_mid)
    rows = tuple(zip(blocks, heads, (n_k * T_L + h_k * H for n_k, h_k in zip(blocks, heads)), live))
    exposed = [stage_overlap(n_k, head_k) for n_k, head_k, _, _ in rows]
    load = [np.where(live, m * t_k + e, -np.inf) for (_, _, t_k, live), e in zip(rows, exposed)]
    pick = np.argmax(np.stack(load), axis=0)
    n_b = np.choose(pick, blocks)
    head_b = np.choose(pick, heads)
    overlap_s = np.choose(pick, exposed)
    if dual.any():
        bubble = np.where(dual, _dualpipe_bubble(pp, n_b, head_b, T_L, F_L, W_L, H, H_F, H_W, a2a_layer,
                                                 mtp_streams, model.mtp_depth, a2a_hidden), bubble)

    # ---- pipeline sends ------------------------------------------------------------------------------
    p2p_msg = np.where((sp > 0) | o.pp_scatter_gather, msg / tp, msg)
    pp_calls = pp_sends_per_step(pp, v, m, bool(o.pp_serial_p2p))
    pp_stream = Stream.of(cluster, "send_recv", p2p_msg, pp_peers, tp_dp, calls=pp_calls, cache=cache)

    # ---- optimizer -------------------------------------------------------------------------------------
    shard = f * (dense_psi / np.where(zero >= 1, replicas * dp, 1)
                 + expert_psi / np.where(zero >= 1, replicas * d_e, 1))
    pcie = topology_of(cluster).pcie_bandwidth_Bps
    off_s, pcie_busy = offload_seconds(shard, o, pcie)
    optimizer = np.where(off > 0, off_s, optimizer_traffic_bytes(shard, o) / W)
    pcie_busy = np.where(off > 0, pcie_busy, 0.0)

    tp_step = m * n_b * tp_layer.seconds
    a2a_step = np.zeros(n) if a2a_hidden else m * n_b * a2a_layer.seconds
    compute = m * (n_b * (3.0 * t_fwd + t_q) + head_b * H)
    recompute = m * n_b * t_rc
    zero3_s = np.zeros(n)
    overhead = np.zeros(n)
    dp_s = overlap_s + param_gather.seconds
    if eager:
        compute, recompute, tp_step, zero3_s, overhead, dp_s, bubble, optimizer = _eager_terms(
            model, cluster, g, m, b, s, msg, n_max, dense_psi, t_fwd, t_rc, t_logits, optimizer)
        a2a_step = np.zeros(n)
    step = compute + recompute + tp_step + a2a_step + zero3_s + overhead + bubble + pp_stream.seconds + dp_s + optimizer

    # ---- memory ------------------------------------------------------------------------------------------
    memory, total, host = stage_memory(model, o, dev, g, m, s, b, n_first, n_last, n_mid, layer_dense, layer_expert,
                                    edge_first, edge_last, d_e)
    host_capacity = topology_of(cluster).host_memory_bytes * (1 - o.host_memory_reserve_fraction)
    host_ok = host * gpn <= host_capacity

    streams = (tp_layer, a2a_layer)
    busy = {}
    for link in ("nvlink", "network"):
        busy[link] = (m * n_b * sum(x.busy(link) for x in streams) + pp_stream.busy(link) + sync.busy(link)
                      + m * head_b * model.mtp_depth * sum(x.busy(link) for x in mtp_streams)
                      + rs_each_mb.busy(link) + param_gather.busy(link) + layer_gather.busy(link) + z3_bwd.busy(link))
    busy["pcie"] = pcie_busy

    # ---- throughput ----------------------------------------------------------------------------------
    hw_per_token = np.array([model.hardware_flops_per_token(seq_len, r) for r in ("none", "selective", "full")])
    tokens = B * s
    return {
        "num_micro_batches": m,
        "step_time_s": step,
        "compute_s": compute,
        "recompute_s": recompute,
        "tp_comm_s": tp_step,
        "ep_comm_s": a2a_step,
        "zero3_gather_s": zero3_s,
        "bubble_s": bubble,
        "pp_comm_s": pp_stream.seconds,
        "dp_comm_s": dp_s,
        "optimizer_s": optimizer,
        "overhead_s": overhead,
        "memory": memory,
        "memory_total": total,
        "host_bytes": host,
        "host_node_bytes": host * gpn,
        "host_feasible": host_ok,
        "link_busy_s": busy,
        "stage_layers": (n_first, n_last, n_mid),
        "feasible": (total <= dev.memory_bytes) & host_ok,
        "tokens_per_s": tokens / step,
        "tflops_per_device": hw_per_token[rc] * tokens / (step * world) / 1e12,
        "mfu": model.model_flops_per_token(seq_len) * tokens / (step * world * full_peak),
    }


def _dualpipe_bubble(pp, n_b, head_b, T_L, F_L, W_L, H, H_F, H_W, a2a_layer, mtp_streams, mtp_depth, a2a_hidden):
    """DualPipe's bubble on the slowest device (``n_b`` blocks and ``head_b`` of the head per micro-batch): its
    chunk's F, B = the rest of its work, W; F&B no less than the overlapped all-to-all of the pair on its busiest
    link (planner/dualpipe.py). The head's F is its compute (``H_F``): the MTP block's forward collectives, if any
    are exposed, count in B."""
    F = n_b * F_L + head_b * H_F
    B = n_b * (T_L - F_L) + head_b * (H - H_F)
    W = n_b * W_L + head_b * H_W
    link = 0.0
    if a2a_hidden:
        link = n_b * np.maximum(a2a_layer.nvlink, a2a_layer.network)
        if mtp_streams:
            a2a_mtp = mtp_streams[1]
            link = link + head_b * mtp_depth * np.maximum(a2a_mtp.nvlink, a2a_mtp.network)
    return dualpipe.dualpipe_bubble(pp, dualpipe.overlapped_pair_seconds(F, B, link), B, W)


def _eager_terms(model, cluster, g, m, b, s, msg, layers, psi, t_fwd, t_rc, t_logits, optimizer):
    """The eager runtime on CPU ranks (a calibrated profile): per-op overheads and the runtime's blocking
    collectives (planner/eager_cost.py); nothing overlaps, every stage runs the head as before."""
    e = eager_cost.eager_terms(model, cluster, g, m, layers, psi, msg, b, s)
    compute_mb = layers * 3.0 * t_fwd + 3.0 * t_logits
    recompute_mb = layers * t_rc
    t_mb = compute_mb + recompute_mb + e["tp_mb"] + e["zero3_mb"] + e["overhead_mb"]
    bubble = np.where(g["pp"] > 1, pipeline_bubble_seconds(g["pp"], g["vpp"], t_mb), 0.0)
    return (m * compute_mb, m * recompute_mb, m * e["tp_mb"], m * e["zero3_mb"], m * e["overhead_mb"],
            m * e["dp_mb"] + e["dp_step"], bubble, optimizer + e["optimizer"])


TIME_TERMS = ("compute_s", "recompute_s", "tp_comm_s", "ep_comm_s", "zero3_gather_s", "bubble_s", "pp_comm_s",
              "dp_comm_s", "optimizer_s", "overhead_s")
MEMORY_TERMS = ("params", "grads", "optimizer", "activations", "zero3_buffer", "reserve")
