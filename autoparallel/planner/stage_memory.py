"""Memory of a pipeline stage per device, and the lower bounds the search prunes with.

A stage holds its weights, gradient buffers and optimizer states (which depend on the ZeRO stage and
offload only) plus its activations (which depend on sp and recompute only): ``state_bytes`` and
``activation_bytes`` are those two halves, written once and used by ``stage_memory`` (the cost model's
memory terms) and ``memory_floors`` (the search's pruning bounds) alike. The stage that needs most is
the first (p micro-batches in flight), the last (the fp32 logits) or the fullest middle stage.
"""
from __future__ import annotations

import numpy as np

from autoparallel.planner import eager_cost
from autoparallel.planner import memory as mem
from autoparallel.planner.mtp import mtp_activation_bytes
from autoparallel.planner.params import block_and_edge_params, largest_stage_params
from autoparallel.planner.stages import stage_layout


def dualpipe_copies(dualpipe, pp):
    """Copies of a stage's weights and gradients one device holds: 2 under DualPipe (``dualpipe`` true, the
    configuration's schedule) with a pipeline (DeepSeek-AI 2024, arXiv:2412.19437 §3.2.1: "DualPipe requires keeping
    two copies of the model parameters", Table 2 "Parameter 2x"; deepseek-ai/DualPipe example_dualpipe.py: rank r
    holds stages r and PP-1-r, each with its own .grad, summed after the step), else 1. Optimizer states: one (not
    stated otherwise)."""
    return np.where(np.asarray(dualpipe, dtype=bool) & (np.asarray(pp) > 1), 2.0, 1.0)


def dualpipe_in_flight(inflight, pp, dualpipe):
    """Micro-batches in flight under DualPipe: 1F1B's times (PP+1)/PP (arXiv:2412.19437 §3.2.1: DualPipe
    increases "the peak activation memory by 1/PP times", Table 2 "Activation PP+1" against 1F1B's "PP")."""
    return np.where(np.asarray(dualpipe, dtype=bool) & (pp > 1), inflight * (pp + 1.0) / np.maximum(pp, 1), inflight)


def stage_rows(model, s, b, tp, sp, pp, v, m, n_first, n_last, n_mid, edge_first, edge_last, scale=1.0,
               head_extra=0.0, dualpipe=False):
    """(blocks, edge Ψ, micro-batches in flight, extra activation bytes) of the first, last and middle stage.

    Extra (Korthikanti et al. §4.3): the embedding dropout's mask for every micro-batch in flight on the first
    stage; the final norm's and output projection's inputs and the fp32 logits on the stage holding the head, with
    ``head_extra`` besides them (multi-token prediction, planner/mtp.py). ``dualpipe``: DualPipe's in-flight
    micro-batches (``dualpipe_in_flight``)."""
    head = mem.logits_bytes(model, s, b, tp) + mem.head_input_bytes(model, s, b, tp, sp, scale) + head_extra
    inflight_first = dualpipe_in_flight(mem.in_flight_micro_batches(pp, v, m), pp, dualpipe)
    inflight_mid = dualpipe_in_flight(mem.in_flight_micro_batches(np.maximum(pp - 1, 1), v, m), pp, dualpipe)
    first_extra = mem.embedding_dropout_bytes(model, s, b, tp, sp) * inflight_first + np.where(pp == 1, head, 0.0)
    return ((n_first, edge_first, inflight_first, first_extra),
            (n_last, edge_last, dualpipe_in_flight(1.0, pp, dualpipe), head),
            (n_mid, 0.0, inflight_mid, 0.0))


def state_bytes(o, dense, expert, zero, dp, d_e, m, off, tensors, trainable=1.0, copies=1.0):
    """Weights, gradient buffers and optimizer states on one device holding ``dense`` and ``expert`` Ψ (dict);
    gradients and optimizer states only for the ``trainable`` share of them (frozen parameters have none);
    weights and gradients ``copies`` times (DualPipe, ``dualpipe_copies``)."""
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
    return {"params": copies * params, "grads": copies * grads,
            "optimizer": opt + mem.per_tensor_state_bytes(tensors, off, o.optimizer_tensor_bytes)}


def activation_bytes(model, o, s, b, tp, sp, rc, layers, inflight, extra):
    """Activations of a stage of ``layers`` blocks with ``inflight`` micro-batches stored, the recompute working
    set and the stage's ``extra`` (logits); an empty stage holds none."""
    store = mem.storage_of(o)
    act = mem.layer_activation_bytes(model, s, b, tp, sp, rc, o.activation_scale, o.flash_attention, store)
    work = mem.recompute_working_bytes(model, s, b, tp, sp, rc, o.activation_scale, o.flash_attention, store)
    return np.where(layers > 0, layers * act * inflight + work + extra, 0.0)


def stage_memory(model, o, dev, g, m, s, b, n_first, n_last, n_mid, layer_dense, layer_expert, edge_first,
                 edge_last, d_e):
    """Per-device memory of the stage that needs most (dict of arrays), its total with the reserve, and the
    host bytes one device uses (offload). DualPipe (``g["dualpipe"]``): a stage's weights and gradients twice and
    its in-flight micro-batches (PP+1)/PP times (its own layout, two different stages per rank, is not modelled)."""
    dual = g["dualpipe"] > 0
    dp, tp, pp, v, sp, zero, rc, off = (g[k] for k in ("dp", "tp", "pp", "vpp", "sp", "zero", "recompute", "offload"))
    z3buf = mem.zero3_gather_buffer_bytes(layer_dense + layer_expert, zero, o.param_bytes)
    tensors = eager_cost.tensors_on_stage(model.op_profile(), np.maximum(n_first, n_last))
    stages = []
    head_extra = mtp_activation_bytes(model, s, b, tp, sp, rc, o.activation_scale, o.flash_attention,
                                      mem.storage_of(o))
    for layers, edge, inflight, extra in stage_rows(model, s, b, tp, sp, pp, v, m, n_first, n_last, n_mid, edge_first,
                                                    edge_last, o.activation_scale, head_extra, dual):
        st = state_bytes(o, layers * layer_dense + edge, layers * layer_expert, zero, dp, d_e, m, off, tensors,
                         model.trainable_fraction, dualpipe_copies(dual, pp))
        st["activations"] = activation_bytes(model, o, s, b, tp, sp, rc, layers, inflight, extra)
        st["zero3_buffer"] = z3buf
        stages.append(st)
    totals = [sum(st.values()) for st in stages]
    pick = np.argmax(np.stack(totals), axis=0)
    memory = {key: np.choose(pick, [st[key] for st in stages]) for key in stages[0]}
    reserve = mem.reserve_bytes(dev.memory_bytes, o.memory_reserve_fraction)
    memory["reserve"] = np.full(pick.shape, reserve)
    total = np.max(np.stack(totals), axis=0) + reserve
    dense_psi = largest_stage_params(n_first, n_last, n_mid, layer_dense, edge_first, edge_last)
    expert_psi = np.maximum(n_first, np.maximum(n_last, n_mid)) * layer_expert
    f = model.trainable_fraction
    host = (mem.host_optimizer_bytes(f * dense_psi, zero, dp, off, o.optimizer_bytes)
            + mem.host_optimizer_bytes(f * expert_psi, zero, d_e, off, o.optimizer_bytes))
    return memory, total, host


def memory_floors(model, cluster, global_batch, seq_len, grid, options, sp_rc, zero_off):
    """Lower bounds of ``evaluate``'s ``memory_total`` for grid arrays of the structural knobs (dp, tp, pp, vpp,
    mb, ep, split, dualpipe), with the same formulas as ``stage_memory``. Returns ``(by_state, by_activation)``:
    ``by_state[i, k]`` bounds configuration i with ``zero_off[k]`` and any (sp, recompute) of ``sp_rc`` (the
    least activations of each stage), and ``by_activation[i, j]`` bounds it with ``sp_rc[j]`` and any (ZeRO,
    offload) of ``zero_off``; each is the stage that needs most plus the reserve. A configuration above either
    bound's device capacity cannot fit."""
    dp, tp, pp, v, b, ep = (np.asarray(grid[k]).reshape(-1) for k in ("dp", "tp", "pp", "vpp", "mb", "ep"))
    split = np.asarray(grid["split"]).reshape(-1)
    dual = np.asarray(grid["dualpipe"]).reshape(-1) > 0
    s, o, n = float(seq_len), options, len(dp)
    m = float(global_batch) / (dp * b)
    n_first, n_last, n_mid = stage_layout(model, seq_len, pp, v, np.where(cluster.runtime is not None, 0, split))
    layer_dense, layer_expert, edge_first, edge_last = block_and_edge_params(model, tp, pp, ep)
    d_e = np.maximum(dp // np.maximum(ep, 1), 1)
    tensors = eager_cost.tensors_on_stage(model.op_profile(), np.maximum(n_first, n_last))
    held, acts = [], []                             # per stage: (len(zero_off), n) and (len(sp_rc), n)
    by_sp = {sp: stage_rows(model, s, b, tp, np.full(n, sp), pp, v, m, n_first, n_last, n_mid, edge_first, edge_last,
                            o.activation_scale, dualpipe=dual) for sp in {sp for sp, _ in sp_rc}}
    for i, (layers, edge, inflight, _) in enumerate(next(iter(by_sp.values()))):
        rows = []
        for zero, off in zero_off:
            z, f = np.full(n, zero), np.full(n, off)
            st = state_bytes(o, layers * layer_dense + edge, layers * layer_expert, z, dp, d_e, m, f, tensors,
                             model.trainable_fraction, dualpipe_copies(dual, pp))
            rows.append(sum(st.values()) + mem.zero3_gather_buffer_bytes(layer_dense + layer_expert, z,
                                                                         o.param_bytes))
        held.append(np.stack(rows))
        acts.append(np.stack([activation_bytes(model, o, s, b, tp, np.full(n, sp), np.full(n, rc), layers, inflight,
                                               by_sp[sp][i][3]) for sp, rc in sp_rc]))
    reserve = mem.reserve_bytes(cluster.device.memory_bytes, o.memory_reserve_fraction)
    by_state = np.max(np.stack([h + a.min(axis=0) for h, a in zip(held, acts)]), axis=0) + reserve
    by_activation = np.max(np.stack([h.min(axis=0) + a for h, a in zip(held, acts)]), axis=0) + reserve
    return by_state.T, by_activation.T
