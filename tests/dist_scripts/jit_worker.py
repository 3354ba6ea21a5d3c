"""Runs on gloo ranks: the article's ``@paddle.jit.to_static`` training step over a parallelized GPT.

    jit_worker.py '<json list of jobs>'

Each job {"name", "dp", "tp", "steps", "negative", "seed_api", "zero", "recompute", "opt", "eager_steps"} parallelizes the tiny GPT
of ``autoparallel.testing.models`` (ap.parallelize, or DataParallel + Optimizer with "seed_api"), decorates
the article's step with paddle's own ``paddle.jit.to_static`` (the labels passed in, as the article elides
them), trains ``steps`` steps (``loss.backward(); opt.step(); opt.clear_grad()``) and reports the losses,
every parameter gathered, whether the step was lowered to a static program (and why not), and how many
programs paddle built.
"""
import json
import sys
import warnings

import paddle
import paddle.distributed as dist


import autoparallel as ap  # noqa: E402
from autoparallel.graph.jit import lowering_state  # noqa: E402
from autoparallel.testing.launch import run_jobs, write_result  # noqa: E402
from autoparallel.testing.models import batch, build, tp_plan  # noqa: E402

LR = 1e-2


def make_optimizer(job, model):
    if job.get("opt") == "sgd":                # scale-sensitive: a gradient reduced twice shows
        return paddle.optimizer.SGD(LR, parameters=model.parameters())
    return paddle.optimizer.AdamW(LR, parameters=model.parameters())


def run(job):
    if job.get("negative"):                    # the program loses its collectives' forward (TP partial sums)
        from autoparallel.graph import jit

        real = jit.static_comm
        jit.static_comm = lambda xs, fwd, bwd: real(xs, lambda v: dict(v), bwd)
        try:
            return run(dict(job, negative=False))
        finally:
            jit.static_comm = real
    model = build("gpt")
    opt = make_optimizer(job, model)
    s = ap.Strategy()
    s.data_parallel.degree = job.get("dp", 1)
    s.tensor_parallel.degree = job.get("tp", 1)
    if job.get("zero"):
        s.sharding.enable = True
        s.sharding.stage = job["zero"]
    if job.get("recompute"):
        s.recompute.enable = True
    plan = tp_plan("gpt") if job.get("tp", 1) > 1 else None
    if job.get("seed_api"):                    # the article's spelling: DataParallel + Optimizer
        model = ap.DataParallel(model, strategy=s, tp_plan=plan)
        opt = ap.Optimizer(opt)
    else:
        model, opt = ap.parallelize(model, opt, strategy=s, tp_plan=plan)

    @paddle.jit.to_static
    def train_step(data, labels):
        with ap.parallel_guard(["data"]):
            logits = model(data)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, labels))
        return loss

    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(job.get("steps", 3)):
            ids, labels = batch(step)
            paddle.jit.enable_to_static(step >= job.get("eager_steps", 0))     # the first steps eager
            loss = train_step(paddle.to_tensor(ids), paddle.to_tensor(labels))
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
    state = lowering_state(train_step) or {}
    lowered = state.get("lowered")
    params = {n: (p.full() if hasattr(p, "full") else p).numpy().tolist() for n, p in model.named_parameters()}
    err = getattr(lowered, "error", None)
    return {"losses": losses, "params": params, "why": state.get("why"), "error_text": str(err) if err else None,
            "programs": lowered.program.get_traced_count() if lowered is not None else 0,
            "notices": [str(w.message) for w in caught if "paddle.jit.to_static" in str(w.message)]}


def main():
    dist.init_parallel_env()
    write_result({"rank": dist.get_rank(), "jobs": run_jobs(run, json.loads(sys.argv[1]))})


if __name__ == "__main__":
    main()
