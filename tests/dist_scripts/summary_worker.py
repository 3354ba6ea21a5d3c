"""Runs on 4 ranks: ``paddle.summary`` / hapi ``Model.summary()`` of distributed models after a training step
(ZeRO-3 has released its parameters then): each rank's totals and rows (tests/test_summary_dist.py compares them
with one process)."""
import io
import contextlib

import numpy as np
import paddle
import paddle.nn.functional as F

import autoparallel as ap
from autoparallel.testing.launch import write_result
from loops2_helpers import MLP, XS, YS


def mlp(stage=0, tp=1):
    paddle.seed(3)
    m = MLP()
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = 4 // tp, tp
    if stage:
        s.sharding.enable, s.sharding.stage = True, stage
    plan = {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()} if tp > 1 else None
    m, opt = ap.parallelize(m, paddle.optimizer.SGD(0.1, parameters=m.parameters()), strategy=s, tp_plan=plan)
    with ap.parallel_guard(["data"]):
        F.mse_loss(m(paddle.to_tensor(XS[0])), paddle.to_tensor(YS[0])).backward()
    opt.step()
    opt.clear_grad()
    return m


def gpt_pipeline():
    from autoparallel.testing.models import build

    s = ap.Strategy()
    s.data_parallel.degree, s.pipeline_parallel.degree = 2, 2
    paddle.seed(0)
    m = build("gpt")
    m, _ = ap.parallelize(m, paddle.optimizer.AdamW(1e-2, parameters=m.parameters()), strategy=s)
    return m


def summarise(m, hapi=False, **kw):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        info = paddle.Model(m).summary(**kw) if hapi else paddle.summary(m, **kw)
    return {"info": {k: int(v) for k, v in info.items()}, "text": buf.getvalue()}


def main():
    from autoparallel.testing.models import batch

    ids = paddle.to_tensor(batch(0)[0])
    out = {"tp2": summarise(mlp(tp=2), input_size=(8, 6)),
           "zero3": summarise(mlp(stage=3), input_size=(8, 6)),
           "zero3 hapi": summarise(mlp(stage=3), hapi=True, input_size=(8, 6)),
           "pp2": summarise(gpt_pipeline(), input=ids)}
    out["pp2"]["params_held"] = int(sum(np.prod(p.shape) for p in gpt_pipeline().parameters()))
    write_result(out)


if __name__ == "__main__":
    ap.init_parallel_env()
    main()
