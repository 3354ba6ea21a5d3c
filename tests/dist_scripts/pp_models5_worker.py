"""Runs on every rank: PaddleFormers causal LMs split into pipeline stages through ``ap.parallelize``, one job per
configuration (family, tied embeddings, layer count, schedule, DP / TP inside the stages, recompute, ZeRO,
accumulation, model keyword inputs, evaluation between steps).

    pp_models5_worker.py OUT_DIR JOBS_JSON

Each rank saves its stages' final parameters (gathered to full tensors) to OUT_DIR/<name>.rank<r>.npz and reports
per job its losses, evaluation losses and pipeline rank (test_probe_pp_models5.py compares them with one process).
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

VOCAB = pf.VOCAB


def model_of(job):
    over = dict(job.get("over", {}))
    over.setdefault("num_hidden_layers", job.get("layers", 4))
    return pf.build(job.get("model", "llama"), **over)


def batch(job, i, b=None):
    """The step's (model keyword inputs, labels): ids, -100 labels, a padding mask and position ids as asked."""
    b, t = b or job.get("b", 4), job.get("t", 8)
    rng = np.random.default_rng(100 + i)
    ids, labels = rng.integers(0, VOCAB, (b, t)), rng.integers(0, VOCAB, (b, t))
    if job.get("ignore"):
        labels[0, :] = -100
        labels[1, : t - 2] = -100
        labels[2, 1::3] = -100
    inputs = {"input_ids": ids}
    if job.get("mask"):
        mask = np.ones((b, t), "int64")
        mask[1, t - 3:] = 0
        inputs["attention_mask"] = mask
    if job.get("pos"):
        pos = np.tile(np.arange(t), (b, 1))
        pos[1::2, t // 2:] -= t // 2                      # two packed sequences in every other row
        inputs["position_ids"] = pos
    return inputs, labels


def as_tensors(inputs):
    return {k: paddle.to_tensor(v) for k, v in inputs.items()}


def optimizer(job, params):
    if job.get("opt", "sgd") == "adamw":
        return paddle.optimizer.AdamW(job.get("lr", 3e-3), parameters=params)
    return paddle.optimizer.SGD(job.get("lr", 0.5), parameters=params)


def strategy(job):
    s = ap.Strategy()
    s.pipeline_parallel.degree = job.get("pp", 2)
    s.pipeline_parallel.schedule = job.get("schedule", "1F1B")
    s.pipeline_parallel.vpp_degree = job.get("vpp", 1)
    if job.get("mb"):
        s.pipeline_parallel.micro_batches = job["mb"]
    s.data_parallel.degree = job.get("dp", 1)
    s.tensor_parallel.degree = job.get("tp", 1)
    if job.get("recompute"):
        s.recompute.enable = True
    if job.get("zero"):
        s.sharding.enable = True
        s.sharding.stage = job["zero"]
    return s


def run_job(job, out_dir, rank):
    model = model_of(job)
    pipe, opt = ap.parallelize(model, optimizer(job, model.parameters()), strategy=strategy(job))
    losses, evals = [], []
    accum = job.get("accum", 1)
    for step in range(job.get("steps", 2)):
        if job.get("eval"):
            pipe.eval()
            inputs, labels = batch(job, 50 + step, job.get("eval_b"))   # eval_b: a batch padded to fit
            with paddle.no_grad():
                if job["eval"] == "call":                   # called like the model: the loss, no gradient
                    out = pipe(**as_tensors(inputs), labels=paddle.to_tensor(labels), return_dict=True)
                    evals.append(float(out.loss))
                else:
                    evals.append(float(pipe.eval_batch(as_tensors(inputs), paddle.to_tensor(labels))))
            pipe.train()
        for k in range(accum):
            inputs, labels = batch(job, step * accum + k)
            if job.get("form") == "call":
                loss = pipe(**as_tensors(inputs), labels=paddle.to_tensor(labels), return_dict=True).loss
                (loss / accum).backward()
                losses.append(float(loss))
            else:
                losses.append(float(pipe.train_batch(as_tensors(inputs), paddle.to_tensor(labels))))
        opt.step()
        opt.clear_grad()
    params = {n: (p.full() if is_dist(p) else p).numpy() for n, p in pipe.named_parameters()}
    np.savez(os.path.join(out_dir, f"{job['name']}.rank{rank}.npz"), **params)
    return {"losses": losses, "evals": evals, "pp_rank": pipe.pp_rank}


def main():
    out_dir, jobs = sys.argv[1], json.loads(sys.argv[2])
    dist.init_parallel_env()
    rank = dist.get_rank()
    write_result({"rank": rank, "jobs": run_jobs(lambda job: run_job(job, out_dir, rank), jobs,
                                                 stop_on_error=True)})


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
