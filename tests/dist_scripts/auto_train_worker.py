"""Runs on every rank: the training example with --auto (auto_mode 'full'), several jobs in one launch.

    auto_train_worker.py OUT_DIR JOBS_JSON
    JOBS_JSON: [{"name": ..., "argv": [train flags], "negative": null | "wrong_batch"}, ...]

Rank 0 saves each job's gathered final parameters to OUT_DIR/<name>.npz; every rank reports its losses,
the strategy the planner chose (the example's log) and what the job printed.
"""
import contextlib
import io
import json
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist


import train_common  # noqa: E402
from train_worker import negative  # noqa: E402

from autoparallel.comm.groups import install_group_store_fix  # noqa: E402
from autoparallel.dist_tensor import is_dist  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402


def run_job(job, out_dir, rank):
    args = train_common.make_parser("gpt-tiny").parse_args(job["argv"])
    printed = io.StringIO()
    with negative(job.get("negative")), contextlib.redirect_stdout(printed):
        log, model, _ = train_common.train(args)
    params = {n: (p.full() if is_dist(p) else p).numpy() for n, p in model.named_parameters()}
    if rank == 0:
        np.savez(os.path.join(out_dir, job["name"] + ".npz"), **params)
    return {"losses": [s["loss"] for s in log["steps"]], "strategy": log["strategy"], "printed": printed.getvalue()}


def main():
    out_dir, jobs = sys.argv[1], json.loads(sys.argv[2])
    dist.init_parallel_env()
    install_group_store_fix()
    rank = dist.get_rank()
    out = {"rank": rank, "jobs": {job["name"]: run_job(job, out_dir, rank) for job in jobs}}
    write_result(out)


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
