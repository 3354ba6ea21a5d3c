"""Memory of a pipeline stage per device, and the lower bounds the search prunes with.

A stage holds its weights, gradient buffers and optimizer states (which depend on the ZeRO stage and
offload only) plus its activations (which depend on sp and recompute only): ``state_bytes`` and
``activation_bytes`` are those two halves, written once and used by ``stage_memory`` (the cost model's
memory terms) and ``memory_floors`` (the search's pruning bounds) alike. The stage that needs most is
the first (p micro-batches in flight), the last (the fp32 logits) or the fullest middle stage; under DualPipe a
device holds two stages (r and p-1-r) and the device that needs most is the fullest such pair (``device_rows``).
"""
from __future__ import annotations

import numpy as np

from autoparallel.planner import eager_cost
from autoparallel.planner import memory as mem
from autoparallel.planner.mtp import mtp_activation_bytes
from autoparallel.planner.params import block_and_edge_params, largest_stage_params
from autoparallel.planner.stages import pair_ranks, stage_layout

# DualPipe (DeepSeek-AI 2024, arXiv:2412.19437 §3.2.1: "DualPipe requires keeping two copies of the model
# parameters"; deepseek-ai/DualPipe example_dualpipe.py: rank r holds stages r and PP-1-r, each with its own weights
# and .grad, the two copies' gradients summed after the step) holds every stage on 2·dp ranks: its data-parallel
# group (gradient sums, ZeRO shards) is twice as wide, each rank's share being its two stages.
DUALPIPE_REPLICAS = 2


def stage_rows(model, s, b, tp, sp, pp, v, m, n_first, n_last, n_mid, edge_first, edge_last, scale=1.0,
               head_extra=0.0):
    """(blocks, edge Ψ, micro-batches in flight, extra activation bytes) of the first, last and middle stage.

    Extra (Korthikanti et al. §4.3): the embedding dropout's mask for every micro-batch in flight on the first
    stage; the final norm's and output projection's inputs and the fp32 logits on the stage holding the head, with
    ``head_extra`` besides them (multi-token prediction, planner/mtp.py)."""
    head = head_bytes(model, s, b, tp, sp, scale, head_extra)
    inflight_first = mem.in_flight_micro_batches(pp, v, m)
    inflight_mid = mem.in_flight_micro_batches(np.maximum(pp - 1, 1), v, m)
    first_extra = mem.embedding_dropout_bytes(model, s, b, tp, sp) * inflight_first + np.where(pp == 1, head, 0.0)
    return ((n_first, edge_first, inflight_first, first_extra),
            (n_last, edge_last, 1.0, head),
            (n_mid, 0.0, inflight_mid, 0.0))


def head_bytes(model, s, b, tp, sp, scale=1.0, head_extra=0.0):
    """Activations of the output head for one micro-batch: the final norm's and the projection's inputs, the fp32
    logits and ``head_extra`` (multi-token prediction)."""
    return mem.logits_bytes(model, s, b, tp) + mem.head_input_bytes(model, s, b, tp, sp, scale) + head_extra


def pair_rows(model, s, b, tp, sp, pp, held, in_flight, valid, edge_first, edge_last, scale=1.0, head_extra=0.0):
    """DualPipe's devices (``stages.pair_ranks``): per rank r < PP/2, (blocks held, edge Ψ, block-micro-batches in
    flight, extra activation bytes, valid). Rank 0 holds both ends: the embedding (its dropout mask for the PP
    micro-batches stage 0 keeps) and the head (one micro-batch of stage PP-1 in flight)."""
    rows = []
    for r in range(held.shape[0]):
        end = (r == 0) & valid[r]
        extra = np.where(end, mem.embedding_dropout_bytes(model, s, b, tp, sp) * pp
                         + head_bytes(model, s, b, tp, sp, scale, head_extra), 0.0)
        rows.append((held[r], np.where(end, edge_first + edge_last, 0.0), in_flight[r], extra, valid[r]))
    return rows


def state_bytes(o, dense, expert, zero, dp, d_e, m, off, tensors, trainable=1.0):
    """Weights, gradient buffers and optimizer states on one device holding ``dense`` and ``expert`` Ψ (dict);
    gradients and optimizer states only for the ``trainable`` share of them (frozen parameters have none); ZeRO
    shards over ``dp`` (dense) and ``d_e`` (routed experts) ranks."""
    per_mb = bool(o.zero_grad_per_micro_batch)
    params = mem.weight_bytes(dense, zero, dp, o.param_bytes) + mem.weight_bytes(expert, zero, d_e, o.param_bytes)
    dense, expert = dense * trainable, expert * trainable      # per-tensor states (beta powers): every tensor
    grads = (mem.grad_buffer_bytes(dense, zero, dp, m, o.grad_bytes, per_mb)
             + mem.grad_buffer_bytes(expert, zero, d_e, m, o.grad_bytes, per_mb))
    opt = (mem.optimizer_bytes(dense, zero, dp, off, o.optimizer_bytes)
           + mem.optimizer_bytes(expert, zero, d_e, off, o.optimizer_bytes))
    if o.zero_master_copy:
        grads = grads + mem.master_grad_bytes(dense, zero, dp)
        opt = opt + mem.master_copy_bytes(dense, zero, dp, off)
    return {"params": params, "grads": grads,
            "optimizer": opt + mem.per_tensor_state_bytes(tensors, off, o.optimizer_tensor_bytes)}


def activation_bytes(model, o, s, b, tp, sp, rc, layers, inflight, extra):
    """Activations of a stage of ``layers`` blocks with ``inflight`` micro-batches stored, the recompute working
    set and the stage's ``extra`` (logits); an empty stage holds none."""
    store = mem.storage_of(o)
    act = mem.layer_activation_bytes(model, s, b, tp, sp, rc, o.activation_scale, o.flash_attention, store)
    work = mem.recompute_working_bytes(model, s, b, tp, sp, rc, o.activation_scale, o.flash_attention, store)
    return np.where(layers > 0, layers * act * inflight + work + extra, 0.0)


def device_rows(model, s, b, tp, sp, pp, v, m, n_first, n_last, n_mid, edge_first, edge_last, pairs, dual,
                scale=1.0, head_extra=0.0):
    """Every device the memory compares, as (blocks held, edge Ψ, micro-batches in flight per block, extra
    activation bytes, copies of a stage per data-parallel replica, live): 1F1B's first, last and middle stage
    (live without DualPipe), then DualPipe's ranks (``pair_rows`` of ``pairs`` = ``stages.pair_ranks``, live with
    it)."""
    rows = [(layers, edge, flight, extra, 1.0, ~dual) for layers, edge, flight, extra in
            stage_rows(model, s, b, tp, sp, pp, v, m, n_first, n_last, n_mid, edge_first, edge_last, scale,
                       head_extra)]
    for held, edge, flight, extra, valid in pair_rows(model, s, b, tp, sp, pp, *pairs, edge_first, edge_last, scale,
                                                      head_extra):
        rows.append((held, edge, flight / np.maximum(held, 1.0), extra, DUALPIPE_REPLICAS, valid & dual))
    return rows


def dual_pairs(model, seq_len, pp, split, dual):
    """``stages.pair_ranks`` when any candidate runs DualPipe, else no rows."""
    if np.any(dual):
        return pair_ranks(model, seq_len, pp, split)
    empty = np.zeros((0, len(pp)))
    return empty, empty, empty.astype(bool)


def stage_memory(model, o, dev, g, m, s, b, n_first, n_last, n_mid, layer_dense, layer_expert, edge_first,
                 edge_last, d_e):
    """Per-device memory of the device that needs most (dict of arrays), its total with the reserve, and the
    host bytes one device uses (offload). Without DualPipe the devices are the first, last and fullest middle
    stage; with it (``g["dualpipe"]``) the ranks, each holding stages r and PP-1-r (``device_rows``)."""
    dual = (g["dualpipe"] > 0) & (g["pp"] > 1)
    dp, tp, pp, v, sp, zero, rc, off = (g[k] for k in ("dp", "tp", "pp", "vpp", "sp", "zero", "recompute", "offload"))
    n = len(dp)
    z3buf = mem.zero3_gather_buffer_bytes(layer_dense + layer_expert, zero, o.param_bytes)
    tensors = eager_cost.tensors_on_stage(model.op_profile(), np.maximum(n_first, n_last))
    head_extra = mtp_activation_bytes(model, s, b, tp, sp, rc, o.activation_scale, o.flash_attention,
                                      mem.storage_of(o))
    pairs = dual_pairs(model, s, pp, g["split"], dual)
    f = model.trainable_fraction
    stages, totals, pair_host = [], [], np.zeros(n)
    for layers, edge, inflight, extra, rep, live in device_rows(model, s, b, tp, sp, pp, v, m, n_first, n_last,
                                                                   n_mid, edge_first, edge_last, pairs, dual,
                                                                   o.activation_scale, head_extra):
        st = state_bytes(o, layers * layer_dense + edge, layers * layer_expert, zero, rep * dp, rep * d_e, m, off,
                         tensors, f)
        st["activations"] = activation_bytes(model, o, s, b, tp, sp, rc, layers, inflight, extra)
        st["zero3_buffer"] = z3buf
        stages.append({key: np.broadcast_to(value, (n,)) for key, value in st.items()})
        totals.append(np.where(live, sum(st.values()), -np.inf))
        if rep != 1:
            row_host = (mem.host_optimizer_bytes(f * (layers * layer_dense + edge), zero, rep * dp, off,
                                                 o.optimizer_bytes)
                        + mem.host_optimizer_bytes(f * layers * layer_expert, zero, rep * d_e, off, o.optimizer_bytes))
            pair_host = np.maximum(pair_host, np.where(live, row_host, 0.0))
    pick = np.argmax(np.stack(totals), axis=0)
    cols = np.arange(n)
    memory = {key: np.stack([st[key] for st in stages])[pick, cols] for key in stages[0]}
    reserve = mem.reserve_bytes(dev.memory_bytes, o.memory_reserve_fraction)
    memory["reserve"] = np.full(n, reserve)
    total = np.stack(totals)[pick, cols] + reserve
    dense_psi = largest_stage_params(n_first, n_last, n_mid, layer_dense, edge_first, edge_last)
    expert_psi = np.maximum(n_first, np.maximum(n_last, n_mid)) * layer_expert
    host = (mem.host_optimizer_bytes(f * dense_psi, zero, dp, off, o.optimizer_bytes)
            + mem.host_optimizer_bytes(f * expert_psi, zero, d_e, off, o.optimizer_bytes))
    return memory, total, np.where(dual, pair_host, host)


def memory_floors(model, cluster, global_batch, seq_len, grid, options, sp_rc, zero_off):
    """Lower bounds of ``evaluate``'s ``memory_total`` for grid arrays of the structural knobs (dp, tp, pp, vpp,
    mb, ep, split, dualpipe), with the same formulas as ``stage_memory``. Returns ``(by_state, by_activation)``:
    ``by_state[i, k]`` bounds configuration i with ``zero_off[k]`` and any (sp, recompute) of ``sp_rc`` (the
    least activations of each device), and ``by_activation[i, j]`` bounds it with ``sp_rc[j]`` and any (ZeRO,
    offload) of ``zero_off``; each is the device that needs most plus the reserve. A configuration above either
    bound's device capacity cannot fit."""
    dp, tp, pp, v, b, ep = (np.asarray(grid[k]).reshape(-1) for k in ("dp", "tp", "pp", "vpp", "mb", "ep"))
    split = np.where(cluster.runtime is not None, 0, np.asarray(grid["split"]).reshape(-1))
    dual = (np.asarray(grid["dualpipe"]).reshape(-1) > 0) & (pp > 1)
    s, o, n = float(seq_len), options, len(dp)
    m = float(global_batch) / (dp * b)
    n_first, n_last, n_mid = stage_layout(model, seq_len, pp, v, split)
    layer_dense, layer_expert, edge_first, edge_last = block_and_edge_params(model, tp, pp, ep)
    d_e = np.maximum(dp // np.maximum(ep, 1), 1)
    tensors = eager_cost.tensors_on_stage(model.op_profile(), np.maximum(n_first, n_last))
    pairs = dual_pairs(model, seq_len, pp, split, dual)
    held, acts = [], []                             # per device: (len(zero_off), n) and (len(sp_rc), n)
    by_sp = {sp: device_rows(model, s, b, tp, np.full(n, sp), pp, v, m, n_first, n_last, n_mid, edge_first,
                             edge_last, pairs, dual, o.activation_scale) for sp in {sp for sp, _ in sp_rc}}
    for i, (layers, edge, inflight, _, rep, live) in enumerate(next(iter(by_sp.values()))):
        rows = []
        for zero, off in zero_off:
            z, f = np.full(n, zero), np.full(n, off)
            st = state_bytes(o, layers * layer_dense + edge, layers * layer_expert, z, rep * dp, rep * d_e, m, f,
                             tensors, model.trainable_fraction)
            rows.append(np.where(live, sum(st.values()) + mem.zero3_gather_buffer_bytes(
                layer_dense + layer_expert, z, o.param_bytes), 0.0))
        held.append(np.stack(rows))
        acts.append(np.stack([np.where(live, activation_bytes(model, o, s, b, tp, np.full(n, sp), np.full(n, rc),
                                                              layers, inflight, by_sp[sp][i][3]), 0.0)
                              for sp, rc in sp_rc]))
    reserve = mem.reserve_bytes(cluster.device.memory_bytes, o.memory_reserve_fraction)
    by_state = np.max(np.stack([h + a.min(axis=0) for h, a in zip(held, acts)]), axis=0) + reserve
    by_activation = np.max(np.stack([h.min(axis=0) + a for h, a in zip(held, acts)]), axis=0) + reserve
    return by_state.T, by_activation.T
