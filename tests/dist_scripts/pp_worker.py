"""Runs on every rank: several pipeline training jobs in one launch.

    pp_worker.py OUT_DIR JOBS_JSON
    JOBS_JSON: [{"name", "schedule", "pp", "dp", "tp", "vpp", "mb", "kind", "tie", "clip", "rc", "amp", "negative"}, ...]
    clip: ClipGradByGlobalNorm(clip) on the optimizer; rc: recompute granularity inside the stages; amp: "float16"
    (loss scale pp_common.AMP_SCALE, SGD)
    negative: null | "no_tie_reduce" (tied gradients not all-reduced: must fail the comparison)

Each rank saves its stages' final parameters (gathered to full tensors) to OUT_DIR/<name>.rank<r>.npz and
reports, per job, its losses, pipeline coordinates and the executed actions of the last step.
"""
import contextlib
import json
import os
import sys
import time
from unittest import mock

import numpy as np
import paddle
import paddle.distributed as dist


import pp_common  # noqa: E402

from autoparallel.dist_tensor import is_dist  # noqa: E402
from autoparallel.parallel.pipeline.runtime import PipelineModule  # noqa: E402
from autoparallel.testing.launch import run_jobs, write_result  # noqa: E402


def negative(kind):
    if kind == "no_tie_reduce":
        return mock.patch.object(PipelineModule, "_reduce_tied", lambda self: None)
    return contextlib.nullcontext()


def run_job(job, out_dir, rank):
    t0 = time.perf_counter()
    with negative(job.get("negative")):
        losses, pipe = pp_common.run_pipeline(job)
    seconds = time.perf_counter() - t0
    params = {n: (p.full() if is_dist(p) else p).numpy() for n, p in pipe.named_parameters()}
    np.savez(os.path.join(out_dir, f"{job['name']}.rank{rank}.npz"), **params)
    return {"losses": losses, "pp_rank": pipe.pp_rank, "coords": list(pipe.coords), "stages": pipe.held_stages,
            "records": [list(r) for r in pipe.records], "seconds": seconds,
            "tied": [n for n, p in pipe.named_parameters() if any(p is q for q, _ in pipe.tied)]}


def main():
    out_dir, jobs = sys.argv[1], json.loads(sys.argv[2])
    dist.init_parallel_env()
    rank = dist.get_rank()
    out = {"rank": rank, "jobs": run_jobs(lambda job: run_job(job, out_dir, rank), jobs, stop_on_error=True)}
    write_result(out)


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
