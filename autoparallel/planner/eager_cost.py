"""Step time of the eager runtime on CPU ranks, where per-op overheads and blocking gloo collectives
dominate: the terms ``cost_model.evaluate`` uses when the cluster profile carries measured runtime costs
(``cluster.runtime``, written by ``autoparallel calibrate``). Every formula is per step on one rank of the
priced pipeline stage; arrays hold one element per candidate. Collectives are priced by the profile's
measured alpha-beta fits per collective and group size; nothing overlaps (gloo blocks).

What the runtime runs per micro-batch (counted on the example models, see model_spec.OpProfile):

    dispatched ops     forward:  L·layer_ops + outside_ops             each costs dispatch_s + backward_s
                       recompute: L·layer_ops (full) or L·core_ops (selective) more forward ops
    tensor parallel    forward:  (L·R + 1) all_reduce of the activation (reduce_scatter under SP) for the
                                 row-parallel linears and the vocab-parallel embedding, + 3 small all_reduces
                                 in the vocab-parallel loss; SP: (L·C + 1) all_gathers into the column-parallel
                                 linears and the LM head
                       backward: (L·C + 1) all_reduce of the activation gradient (reduce_scatter under SP);
                                 SP: (L·R + 1 + positions) all_gathers
    data parallel      2 scalar all_reduces (the loss mean and reading the loss) + the position table's
                       gradient (models with learned positions; first pipeline stage)
    pipeline           stage-to-stage sends (cost_model.pp_sends_per_step), one scalar all_reduce of the
                       loss over all ranks per step
    ZeRO-3             (2 + full recompute) all_gathers per parameter-owning layer
per step: gradient buckets of 25 MB (all_reduce; ZeRO: reduce_scatter, and all_gather of the updated chunks
at stage 1-2), an AdamW update per parameter tensor, and the flatten/scale/slice ops around them.
"""
from __future__ import annotations

import numpy as np

from autoparallel.planner.memory import FULL, SELECTIVE

BUCKET_BYTES = 25 * 2 ** 20          # gradient bucket of the data-parallel and ZeRO runtimes
LOSS_REDUCTIONS = 2                  # data-parallel scalar all_reduces per micro-batch: loss mean, loss read
VOCAB_LOSS_REDUCTIONS = 3            # vocab-parallel cross-entropy: max, sum of exponentials, target logit


def collective_seconds(cluster, collective, nbytes, n):
    """Seconds of one ``collective`` over groups of ``n`` ranks (arrays), ``nbytes`` held per rank: the
    profile's measured fit for that group size, else the link's alpha-beta formula (comm/cost.py)."""
    from autoparallel.planner.cost_model import affine_seconds

    n = np.asarray(n).reshape(-1)
    nbytes = np.broadcast_to(np.asarray(nbytes, dtype=float), n.shape)
    out = np.zeros(n.shape)
    for size in np.unique(n):
        if size <= 1:
            continue
        c0, c1 = affine_seconds(cluster, collective, int(size), range(int(size)))
        sel = n == size
        out[sel] = c0 + c1 * nbytes[sel]
    return out


def dispatched_ops(ops, layers, recompute):
    """(forward ops, recomputed forward ops) per micro-batch on one stage."""
    forward = layers * ops.layer_ops + ops.outside_ops
    again = np.where(recompute == FULL, layers * ops.layer_ops,
                     np.where(recompute == SELECTIVE, layers * ops.core_ops, 0))
    return forward, again


def dispatch_seconds(runtime, forward, again):
    """Per-op overheads of a micro-batch: every forward op is dispatched and has a backward; every
    recomputed op costs the measured recompute cost (dispatch plus the saved-tensor machinery)."""
    return forward * (runtime.dispatch_s + runtime.backward_s) + again * runtime.recompute_op_s


def tp_collectives_seconds(cluster, model, ops, layers, msg, tp, sp, recompute, tokens_bytes):
    """Tensor-parallel (and sequence-parallel) collectives of one micro-batch (see module docstring)."""
    ar = collective_seconds(cluster, "all_reduce", msg, tp)
    rs = collective_seconds(cluster, "reduce_scatter", msg, tp)
    ag = collective_seconds(cluster, "all_gather", msg / tp, tp)
    small = collective_seconds(cluster, "all_reduce", tokens_bytes, tp)
    row = layers * ops.row_parallel + 1
    col = layers * ops.col_parallel + 1
    row_rc = np.where(recompute == FULL, layers * ops.row_parallel, 0)
    col_rc = np.where(recompute == FULL, layers * ops.col_parallel, 0)
    reduce_ = np.where(sp > 0, rs, ar)
    gathers = np.where(sp > 0, (col + col_rc + row + int(model.learned_positions)) * ag, 0.0)
    total = (row + row_rc + col) * reduce_ + gathers + VOCAB_LOSS_REDUCTIONS * small
    return np.where(tp > 1, total, 0.0)


def dp_micro_seconds(cluster, model, dp, tp, sp, pp):
    """Data-parallel collectives of one micro-batch: the loss scalars and the position table's gradient
    (on the first pipeline stage: part of the priced, last, stage only without a pipeline)."""
    scalars = LOSS_REDUCTIONS * collective_seconds(cluster, "all_reduce", 4.0, dp)
    table = model.position_params * 4.0 / np.where(sp > 0, tp, 1)
    positions = collective_seconds(cluster, "all_reduce", table, dp) if model.learned_positions else 0.0
    return np.where(dp > 1, scalars + np.where(pp > 1, 0.0, positions), 0.0)


def pipeline_loss_seconds(cluster, world, pp):
    """The pipeline runtime shares the step's loss with every rank: one scalar all_reduce over the world."""
    return np.where(pp > 1, collective_seconds(cluster, "all_reduce", 4.0, world), 0.0)


def buckets(grad_bytes):
    """Gradient buckets of a step: ceil(bytes / 25 MB)."""
    return np.maximum(1, np.ceil(grad_bytes / BUCKET_BYTES))


def norm_tensors(model, layers):
    """Norm weight (and bias) tensors of a stage: reduced over TP under sequence parallelism."""
    per_norm = 2 if model.layernorm else 1
    return (2 * layers + 1) * per_norm


def norm_bytes(model, layers):
    return norm_tensors(model, layers) * model.hidden * 4.0


def dp_step_seconds(cluster, model, layers, psi, dp, tp, sp, zero):
    """Gradient synchronisation of a step: buckets over dp (ZeRO: reduce_scatter + all_gather of the
    updated chunks at stage 1-2); SP's norm gradients over tp (and dp) besides."""
    grad = 4.0 * psi * model.trainable_fraction         # frozen parameters send no gradient
    nb = buckets(grad)
    ar = collective_seconds(cluster, "all_reduce", grad / nb, dp)
    rs = collective_seconds(cluster, "reduce_scatter", grad / nb, dp)
    ag = collective_seconds(cluster, "all_gather", grad / nb / dp, dp)
    plain = nb * ar
    zero_sync = nb * (np.where(zero == 1, ar, rs) + np.where(zero <= 2, ag, 0.0))
    norms = norm_bytes(model, layers)
    sp_plain = (collective_seconds(cluster, "all_reduce", norms, tp)
                + np.where(dp > 1, collective_seconds(cluster, "all_reduce", norms, dp), 0.0))
    sp_zero = norm_tensors(model, layers) * collective_seconds(cluster, "all_reduce", model.hidden * 4.0, tp)
    sync = np.where(dp > 1, np.where(zero == 0, plain, zero_sync), 0.0)
    sp_sync = np.where((sp > 0) & (tp > 1), np.where(zero == 0, sp_plain, sp_zero), 0.0)
    return sync + sp_sync


def zero3_micro_seconds(cluster, ops, layers, psi, dp, zero, recompute):
    """ZeRO-3 gathers of one micro-batch: one all_gather per parameter-owning layer in the forward and
    again in the backward (and in a recomputed forward)."""
    owners = layers * ops.layer_param_layers + ops.outside_param_layers
    per_owner = 4.0 * psi / owners / dp
    calls = (2 + (recompute == FULL)) * owners
    return np.where((zero >= 3) & (dp > 1), calls * collective_seconds(cluster, "all_gather", per_owner, dp), 0.0)


def tensors_on_stage(ops, layers):
    return layers * ops.layer_tensors + ops.outside_tensors


def plain_ops_per_step(tensors, dp, zero, micro_batches):
    """Eager ops around the optimizer: flatten/unflatten into buckets (6 per tensor), scaling accumulated
    gradients (2 per tensor), ZeRO packing into dp chunks ((2·dp + 12) per tensor at stage 1-2, (dp + 8) at
    stage 3, plus (dp + 5) per tensor for every ZeRO-3 gather)."""
    dp_ops = np.where((dp > 1) & (zero == 0), 6 * tensors, 0)
    accumulate = np.where((micro_batches > 1) & (zero == 0), 2 * tensors, 0)
    zero_ops = np.where(zero == 0, 0, np.where(zero <= 2, (2 * dp + 12) * tensors, (dp + 8) * tensors))
    gathers = np.where(zero >= 3, 2 * micro_batches * (dp + 5) * tensors, 0)
    return dp_ops + accumulate + zero_ops + gathers


def optimizer_seconds(runtime, tensors, plain_ops):
    """AdamW per parameter tensor (chunk) plus the eager ops around it."""
    return tensors * runtime.optimizer_tensor_s + plain_ops * runtime.op_s


def eager_terms(model, cluster, g, m, layers, psi, msg, b, s):
    """Per-micro-batch and per-step eager terms of every candidate (dict of arrays, seconds)."""
    rt = cluster.runtime
    ops = model.op_profile()
    dp, tp, pp, sp, zero, rc = g["dp"], g["tp"], g["pp"], g["sp"], g["zero"], g["recompute"]
    forward, again = dispatched_ops(ops, layers, rc)
    tensors = tensors_on_stage(ops, layers)
    micro = np.asarray(m)
    return {
        "overhead_mb": dispatch_seconds(rt, forward, again),
        "tp_mb": tp_collectives_seconds(cluster, model, ops, layers, msg, tp, sp, rc, 4.0 * b * s),
        "dp_mb": dp_micro_seconds(cluster, model, dp, tp, sp, pp),
        "zero3_mb": zero3_micro_seconds(cluster, ops, layers, psi, dp, zero, rc),
        "dp_step": (dp_step_seconds(cluster, model, layers, psi, dp, tp, sp, zero)
                    + pipeline_loss_seconds(cluster, dp * tp * pp, pp)),
        "optimizer": optimizer_seconds(rt, tensors, plain_ops_per_step(tensors, dp, zero, micro)),
    }
