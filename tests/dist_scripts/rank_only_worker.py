"""Runs on 2 ranks: code that runs on rank 0 only.

* data parallel: ``if rank == 0:`` reads of the loss (``item()``, ``float``, an f-string, ``numpy()``) during
  training; the values and the collectives those reads made;
* ZeRO-3: rank 0 alone gathers the full state_dict while rank 1 goes on to its next step;
* tensor parallel: rank 0 alone runs an evaluation forward while rank 1 goes on to its next step;
* data parallel: rank 0 alone calls ap.save_state_dict while rank 1 goes on to its next step.
The reads run with the defaults, the refusals with the collective check on (AP_COLLECTIVE_CHECK=on); they are
caught on each rank and reported (type, text, seconds from the first rank's divergence).
Usage: rank_only_worker.py OUT_DIR
"""
import os
import sys
import time

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

import autoparallel as ap
from autoparallel.comm.counter import count_comm
from autoparallel.testing.launch import write_result
from test_probe_rank_only_values import MLP

STEPS = 3


def batches():
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((8, 8)).astype("float32"), rng.integers(0, 4, (8,))) for _ in range(STEPS + 1)]


def build(**degrees):
    paddle.seed(0)
    m = MLP()
    opt = paddle.optimizer.SGD(0.1, parameters=m.parameters())
    s = ap.Strategy()
    s.data_parallel.degree = degrees.get("dp", 1)
    s.tensor_parallel.degree = degrees.get("tp", 1)
    if degrees.get("zero"):
        s.sharding.enable, s.sharding.stage = True, degrees["zero"]
    plan = {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()} if degrees.get("tp", 1) > 1 else None
    return ap.parallelize(m, opt, strategy=s, tp_plan=plan)


def step(m, opt, x, y):
    with ap.parallel_guard(["data"]):
        loss = F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
    return loss


def rank0_reads(rank):
    m, opt = build(dp=2)
    out = {"every_rank": [], "rank0": [], "read_calls": None}
    for x, y in batches()[:STEPS]:
        loss = step(m, opt, x, y)
        if rank == 0:
            with count_comm() as log:
                out["rank0"].append([loss.item(), float(loss), float(f"{float(loss)}"), float(loss.numpy())])
            out["read_calls"] = [c[0] for c in log.calls]
        out["every_rank"].append(float(loss))
    return out


def refused(rank, rank0_only, others):
    """Run ``rank0_only`` on rank 0 and ``others`` elsewhere; report what each rank raised and when."""
    dist.barrier()
    start = time.monotonic()
    try:
        (rank0_only if rank == 0 else others)()
        return {"error": None, "seconds": time.monotonic() - start}
    except Exception as e:                       # noqa: BLE001  (reported to the test)
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}


def zero3_state_dict(rank):
    m, opt = build(dp=2, zero=3)
    data = batches()
    step(m, opt, *data[0])
    return refused(rank, lambda: {k: v.numpy() for k, v in m.state_dict().items()}, lambda: step(m, opt, *data[1]))


def tp_eval(rank):
    m, opt = build(tp=2)
    data = batches()
    step(m, opt, *data[0])

    def evaluate():
        with paddle.no_grad():
            return float(m(paddle.to_tensor(data[STEPS][0])).sum())

    return refused(rank, evaluate, lambda: step(m, opt, *data[1]))


def dp_save(rank, out_dir):
    m, opt = build(dp=2)
    data = batches()
    step(m, opt, *data[0])
    path = os.path.join(out_dir, "rank0_only")
    got = refused(rank, lambda: ap.save_state_dict(m.state_dict(), path), lambda: step(m, opt, *data[1]))
    return dict(got, written=os.path.exists(path))


def main():
    dist.init_parallel_env()
    rank = dist.get_rank()
    out = {"reads": rank0_reads(rank)}                     # the defaults: no collective check
    before = os.environ.get("AP_COLLECTIVE_CHECK")
    os.environ["AP_COLLECTIVE_CHECK"] = "on"               # on every rank at the same point
    try:
        out.update(zero3_state_dict=zero3_state_dict(rank), tp_eval=tp_eval(rank), dp_save=dp_save(rank, sys.argv[1]))
    finally:
        os.environ.pop("AP_COLLECTIVE_CHECK")
        if before is not None:
            os.environ["AP_COLLECTIVE_CHECK"] = before
    write_result(out)


if __name__ == "__main__":
    main()
