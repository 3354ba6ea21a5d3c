"""Runs on every rank of a 4-rank launch: ZeRO stage 1 / 2 inside the stages of a PP2 x DP2 pipeline.

    pp_zero_worker.py OUT_DIR STEPS

Jobs, all with a binding ClipGradByGlobalNorm(0.05): ZeRO-1 (1F1B), ZeRO-2 (VPP v=2, a tied embedding / LM head
on the first and last stage), the 1F1B pipeline without ZeRO (the unsharded optimizer-state size), and ZeRO-2
under VPP resumed from the checkpoint ZeRO-1 saved after its second step (steps 3-4), and the FThenB pipeline
trained by the user's own loss, ``F.cross_entropy(pipe(x), y).mean().backward()`` (no ZeRO; rank 0 alone reads the
loss after backward, with no collective), and last (it ends in an error on every rank) the same loss read by
rank 0 alone before backward. Each rank saves its stages' final parameters (full tensors)
to OUT_DIR/<name>.rank<r>.npz and reports per job its losses, clip norms, pipeline coordinates, the elements of
AdamW's moment1 it holds, and (ZeRO-1 and plain 1F1B) what paddle's ``opt.state_dict()`` holds, gathered.
"""
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist

import pp_common  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel.dist_tensor import is_dist  # noqa: E402
from autoparallel.parallel.pipeline.runtime import apply_pp  # noqa: E402
from autoparallel.testing.launch import run_jobs, write_result  # noqa: E402

CLIP = 0.05
JOBS = [{"name": "zero1_1f1b", "schedule": "1F1B", "dp": 2, "zero": 1, "save_after": 2},
        {"name": "zero2_resume", "schedule": "VPP", "vpp": 2, "dp": 2, "zero": 2, "resume": True},
        {"name": "zero2_vpp_tied", "schedule": "VPP", "vpp": 2, "dp": 2, "zero": 2, "tie": True,
         "save_final": True},
        {"name": "plain_1f1b", "schedule": "1F1B", "dp": 2},
        {"name": "external_fthenb", "schedule": "FThenB", "dp": 2, "external": True},
        {"name": "external_read_before_backward", "schedule": "FThenB", "dp": 2, "read_before": True}]   # last: an error


def external_step(pipe, x, y, scaled: bool):
    """The one-process step written by the user: loss_fn(model(x), y), then backward (external_loss.py), of the
    loss or (``scaled``) of ``loss * 1.0`` (its value kept on the loss it was computed from): the loss."""
    import paddle.nn.functional as F

    loss = F.cross_entropy(pipe(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
    (loss * 1.0 if scaled else loss).backward()
    return loss


def rank_only_read(loss) -> dict:
    """The logging line ``if rank == 0: print(float(loss))`` after backward: the value kept on the tensor, read with
    no collective (rank 0 holds no shard of the loss: a collective here would wait for the others)."""
    from autoparallel.comm.counter import count_comm

    with count_comm() as log:
        values = [float(loss), loss.item(), float(loss.numpy()), float(f"{loss:.6f}")]
    return {"values": values, "calls": len(log.calls)}


def read_before_backward(job, rank) -> dict:
    """``if rank == 0: float(loss)`` BEFORE loss.backward(): every rank raises LossReadOnSomeRanksError (rank 0 in
    its read, the others in backward); then (the ranks agree again: each made the same exchanges) on a new pipeline,
    rank 0 alone reads ``loss * 2`` made after backward (not kept) while the others call the pipeline again: the
    error again, at the call's first exchange. Per case: the error's type, text and the seconds it took."""
    import paddle.nn.functional as F

    x, y = pp_common.batches(1)[0]
    out = {}
    for case in ("before_backward", "derived_after_backward"):
        pipe = apply_pp(pp_common.build("gpt"), pp_common.strategy(job))
        loss = F.cross_entropy(pipe(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
        if case == "derived_after_backward":
            loss.backward()
        out[case] = _expect_refused(lambda: float(loss if case == "before_backward" else loss * 2), rank,
                                    lambda: loss.backward() if case == "before_backward" else pipe(paddle.to_tensor(x)))
    return out


def _expect_refused(read, rank, others) -> dict:
    import time

    from autoparallel.parallel.pipeline.loss_sync import LossReadOnSomeRanksError

    start = time.perf_counter()
    try:
        if rank == 0:
            read()
        others()
    except LossReadOnSomeRanksError as e:
        return {"error_type": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - start}
    return {"error_type": None, "seconds": time.perf_counter() - start}


def moment_elements(opt) -> int:
    if hasattr(opt, "zeros"):
        return sum(int(np.prod(t.shape)) for z in opt.zeros for r in z.held
                   for t in z.inner_opts[r]._accumulators["moment1"].values())
    return sum(int(np.prod(t.shape)) for t in opt._inner._accumulators["moment1"].values())


def moment_sums(opt, pipe) -> dict:
    """paddle's ``opt.state_dict()`` of this rank's stages: {structured name: [sum |moment1|, sum moment1]} of the
    gathered state (``ap.full_state_dict``) and the layouts of the moments it gives."""
    sd = opt.state_dict()
    full = ap.full_state_dict(opt)
    sums = {}
    for struct, p in pipe.named_parameters():
        v = full.get(f"{p.name}_moment1_0")
        if v is not None:
            a = np.asarray(v, dtype="float64")
            sums[struct] = [float(np.abs(a).sum()), float(a.sum())]
    layouts = sorted({str([str(x) for x in v.placements]) for k, v in sd.items()
                      if k.endswith("_moment1_0") and is_dist(v)})
    return {"sums": sums, "layouts": layouts, "plain": sorted(k for k, v in sd.items() if k.endswith("_moment1_0")
                                                              and not is_dist(v))}


def run_job(job, out_dir, rank, steps):
    if job.get("read_before"):
        return read_before_backward(job, rank)
    s = pp_common.strategy(job)
    if job.get("zero"):
        s.sharding.enable, s.sharding.stage = True, job["zero"]
    model = pp_common.build("gpt", job.get("tie", False))
    pipe = apply_pp(model, s)
    opt = pipe.wrap_optimizer(pp_common.optimizer(model.parameters(), CLIP))
    ck = os.path.join(out_dir, "zero1_ck")
    data = pp_common.batches(steps)
    if job.get("resume"):                         # the checkpoint zero1_1f1b saved after its second step
        ap.load_state_dict(ap.training_state(pipe, opt), ck)
        data = data[2:]
    losses, norms, reads = [], [], []
    for k, (x, y) in enumerate(data):
        loss = external_step(pipe, x, y, k % 2 == 1) if job.get("external") else pipe.train_batch(x, y)
        if job.get("external") and rank == 0:
            reads.append(rank_only_read(loss))
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.clear_grad()
        losses.append(float(loss))                # after backward: kept on every rank, read locally
        if k + 1 == job.get("save_after"):
            ap.save_state_dict(ap.training_state(pipe, opt), ck)
    if job.get("save_final"):
        ap.save_state_dict(ap.training_state(pipe, opt), os.path.join(out_dir, f"{job['name']}_ck"))
    params = {n: (p.full() if is_dist(p) else p).numpy() for n, p in pipe.named_parameters()}
    np.savez(os.path.join(out_dir, f"{job['name']}.rank{rank}.npz"), **params)
    return {"losses": losses, "norms": norms, "pp_rank": pipe.pp_rank, "coords": list(pipe.coords),
            "moments": moment_elements(opt), "kind": type(opt).__name__, "rank0_reads": reads,
            "state_dict": moment_sums(opt, pipe) if job["name"] in ("zero1_1f1b", "plain_1f1b") else {}}


def main():
    out_dir, steps = sys.argv[1], int(sys.argv[2])
    dist.init_parallel_env()
    rank = dist.get_rank()
    write_result({"rank": rank, "jobs": run_jobs(lambda job: run_job(job, out_dir, rank, steps), JOBS,
                                                 stop_on_error=True)})


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
