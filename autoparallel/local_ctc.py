"""``paddle.nn.functional.ctc_loss`` (and ``paddle.nn.CTCLoss``) on distributed tensors.

CTC's loss is a sum over alignment paths of one sample, so samples are independent: the per-sample losses of a
batch split over some mesh dims are the local op's on each shard. Here ``log_probs`` ``[time, batch, classes]``
keeps a split of its batch dim (1) and is gathered on every other mesh dim (time and classes are whole on every
rank); ``labels`` ``[batch, max_label]`` and both length vectors ``[batch]`` are laid out to match (a plain
tensor is sliced, as a replicated one). paddle's own op (``warpctc``, reduction 'none') runs on each shard,
and the reductions are paddle's own formulas written with distributed ops, so 'mean' divides each loss by its
label length and averages over the WHOLE batch, 'sum' sums it, and ``zero_infinity`` zeroes infinite losses —
what one process computes. The gradient reaches the log-probabilities through the local op's own backward."""
from __future__ import annotations

import paddle

from autoparallel.core.placement import Replicate, Shard


def ctc_loss(log_probs, labels, input_lengths, label_lengths, blank=0, reduction="mean", norm_by_times=False,
             zero_infinity=False, name=None):
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"ctc_loss: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    loss = _per_sample(log_probs, labels, input_lengths, label_lengths, blank, norm_by_times)
    if zero_infinity:
        loss = paddle.where(paddle.isinf(loss), paddle.zeros_like(loss), loss)
    if reduction == "mean":
        return paddle.mean(loss / label_lengths.astype(loss.dtype))
    if reduction == "sum":
        return paddle.sum(loss)
    return loss


def _per_sample(log_probs, labels, input_lengths, label_lengths, blank, norm_by_times):
    """The ``[batch]`` losses, split over the mesh dims that split ``log_probs``' batch."""
    from autoparallel.api_local import run_local
    from autoparallel.dist_tensor import as_dist, is_dist

    if not is_dist(log_probs):
        raise NotImplementedError("ctc_loss with distributed labels or lengths but plain log_probs: shard "
                                  "log_probs over the batch (dim 1) the way the labels are, or pass plain labels")
    lp = as_dist(log_probs)
    if lp.ndim != 3:
        raise ValueError(f"ctc_loss: log_probs must be 3-D [max_logit_length, batch_size, num_classes + 1], "
                         f"got shape {list(lp.global_shape)}")
    mesh = lp.mesh
    batch = [Shard(1) if isinstance(p, Shard) and p.dim == 1 else Replicate() for p in lp.placements]
    rows = [Shard(0) if isinstance(p, Shard) else Replicate() for p in batch]
    args = [_laid_out(lp, mesh, batch)] + [_laid_out(t, mesh, rows) for t in (labels, input_lengths, label_lengths)]

    def local(lp_, lab, il, ll):
        return paddle.nn.functional.ctc_loss(lp_, lab, il, ll, blank=blank, reduction="none",
                                             norm_by_times=norm_by_times)

    return run_local(local, args, {}, [(mesh, tuple(rows))], "ctc_loss", global_shapes=[[lp.global_shape[1]]])


def _laid_out(t, mesh, placements):
    from autoparallel.api_tensor import reshard, shard_tensor
    from autoparallel.dist_tensor import as_dist, is_dist

    if not is_dist(t):
        return shard_tensor(t, mesh, placements)
    t = as_dist(t)
    if t.mesh != mesh:
        raise ValueError(f"ctc_loss: every distributed input must be on log_probs' mesh {mesh}, got one on "
                         f"{t.mesh}")
    return t if list(t.placements) == list(placements) else reshard(t, mesh, placements)
