"""Runs on every rank (2) of a gloo job: options that must act or be refused on every rank.

* ``merge``: ``strategy.gradient_accumulation_steps = 2`` then paddle's ``strategy.gradient_merge.enable = True``
  under ``ap.parallelize`` (DP2): two backward passes and one ``opt.step()`` equal a plain one-process paddle loop
  over both micro-batches, each loss halved (the step averages the two micro-steps).
* ``plain``: a plain paddle optimizer over an ``ap.DataParallel`` model whose strategy shards (no
  ``ap.Optimizer``): its step raises ValueError on both ranks.
* ``guard``: ``ap.parallel_guard([])`` around a 2-stage pipeline's ``train_batch`` raises NotImplementedError on
  both ranks (the stage without the inputs too), and the pipeline then trains as before.

    option_effects5_worker.py OUT_DIR
"""
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

import autoparallel as ap
from autoparallel.testing.launch import write_result
from autoparallel.testing.models import batch, build

LR = 0.5


def _full(p) -> np.ndarray:
    return ap.unshard_dtensor(p).numpy() if hasattr(p, "placements") else p.numpy()


def merge_reference() -> dict:
    """One process, plain paddle: two micro-batches, each loss / 2, one SGD step."""
    model = build("gpt")
    opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
    for i in range(2):
        ids, lab = batch(i)
        (F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean() / 2).backward()
    opt.step()
    return {n: p.numpy() for n, p in model.named_parameters()}


def merge() -> dict:
    s = ap.Strategy()
    s.data_parallel.degree = 2
    s.gradient_accumulation_steps = 2
    s.gradient_merge.enable = True                 # paddle's switch after our field: keeps the 2 steps
    model = build("gpt")
    start = {n: p.numpy() for n, p in model.named_parameters()}
    opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
    model, opt = ap.parallelize(model, opt, strategy=s)
    for i in range(2):                             # the loss as it is: the step averages the micro-steps
        ids, lab = batch(i)
        F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean().backward()
    opt.step()
    opt.clear_grad()
    want = merge_reference()
    err = max(float(np.abs(_full(p) - want[n]).max()) for n, p in model.named_parameters())
    moved = max(float(np.abs(_full(p) - start[n]).max()) for n, p in model.named_parameters())
    return {"steps": s.gradient_accumulation_steps, "moved": moved, "err": err}


def plain() -> dict:
    """A plain optimizer over an ap.DataParallel model whose strategy shards (ZeRO): refused at its step."""
    s = ap.Strategy()
    s.data_parallel.degree = 2
    s.sharding.enable = True
    model = ap.DataParallel(build("gpt"), strategy=s)
    opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
    ids, lab = batch(0)
    F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean().backward()
    try:
        opt.step()
    except ValueError as e:
        return {"raised": str(e)}
    return {"raised": None}


def guard() -> dict:
    s = ap.Strategy()
    s.pipeline_parallel.degree = 2
    s.pipeline_parallel.schedule = "FThenB"
    model = build("gpt")
    opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
    pipe, opt = ap.parallelize(model, opt, strategy=s)
    ids, lab = batch(0)
    out = {"raised": None}
    try:
        with ap.parallel_guard([]):
            pipe.train_batch(paddle.to_tensor(ids), paddle.to_tensor(lab))
    except NotImplementedError as e:
        out["raised"] = str(e)
    loss = pipe.train_batch(paddle.to_tensor(ids), paddle.to_tensor(lab))
    opt.step()
    opt.clear_grad()
    out["loss_after"] = None if loss is None else float(loss)
    return out


def main():
    os.makedirs(sys.argv[1], exist_ok=True)
    dist.init_parallel_env()
    write_result({"rank": dist.get_rank(), "merge": merge(), "plain": plain(), "guard": guard()})


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
