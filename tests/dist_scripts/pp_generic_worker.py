"""Runs on every rank: pipeline jobs on a PaddleFormers Llama split at its blocks (no embed()/head()), data or
tensor parallelism inside the stages, through ``ap.parallelize``.

    pp_generic_worker.py OUT_DIR JOBS_JSON
    JOBS_JSON: [{"name", "dp", "tp", "schedule", "tie", "sharding", "steps", "lr"}, ...]

Each rank saves its stages' final parameters (gathered to full tensors) to OUT_DIR/<name>.rank<r>.npz and
reports, per job, its losses and pipeline coordinates.
"""
import json
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist

import autoparallel as ap
from autoparallel.dist_tensor import is_dist
from autoparallel.testing import paddleformers_models as pf
from autoparallel.testing.launch import run_jobs, write_result


def run_job(job, out_dir, rank):
    s = ap.Strategy()
    s.pipeline_parallel.degree = 2
    s.pipeline_parallel.schedule = job.get("schedule", "1F1B")
    s.data_parallel.degree = job.get("dp", 1)
    s.tensor_parallel.degree = job.get("tp", 1)
    if job.get("sharding"):
        s.sharding.enable, s.sharding.stage = True, job["sharding"]
    model = pf.build("llama", tie_word_embeddings=job.get("tie", False), num_hidden_layers=4)
    opt = paddle.optimizer.SGD(job["lr"], parameters=model.parameters())
    pipe, opt = ap.parallelize(model, opt, strategy=s)
    losses = []
    for step in range(job["steps"]):
        losses.append(pipe.train_batch(*pf.batch(step, b=4, t=8)))
        opt.step()
        opt.clear_grad()
    params = {n: (p.full() if is_dist(p) else p).numpy() for n, p in pipe.named_parameters()}
    np.savez(os.path.join(out_dir, f"{job['name']}.rank{rank}.npz"), **params)
    return {"losses": losses, "pp_rank": pipe.pp_rank, "coords": list(pipe.coords)}


def main():
    out_dir, jobs = sys.argv[1], json.loads(sys.argv[2])
    dist.init_parallel_env()
    rank = dist.get_rank()
    write_result({"rank": rank, "jobs": run_jobs(lambda job: run_job(job, out_dir, rank), jobs, stop_on_error=True)})


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
