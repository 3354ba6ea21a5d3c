"""Rank side of tools/bench_agreement.py: the cost of the collective agreement check and of settling one-element
Partial results, on this machine's gloo ranks."""
import os
import sys
import time

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn as nn
import paddle.nn.functional as F

import autoparallel as ap
from autoparallel.comm import agreement, transport
from autoparallel.comm.transport import RealTransport
from autoparallel.testing.launch import write_result


def per_call(transport, rank, numel, repeat):
    x = paddle.ones([numel], dtype="float32")
    for _ in range(5):
        transport.all_reduce({rank: x}, [0, 1], "sum")
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeat):
        transport.all_reduce({rank: x}, [0, 1], "sum")
    return (time.perf_counter() - start) / repeat


def step_time(rank, steps, settle, check):
    os.environ["AP_SCALAR_REDUCE"], os.environ["AP_COLLECTIVE_CHECK"] = settle, check
    paddle.seed(0)
    m = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    opt = paddle.optimizer.SGD(0.01, parameters=m.parameters())
    s = ap.Strategy()
    s.data_parallel.degree = 2
    m, opt = ap.parallelize(m, opt, strategy=s)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 256)).astype("float32"), rng.standard_normal((32, 256)).astype("float32")
    times, checks = [], agreement.stats()["checks"]
    for k in range(steps + 3):
        dist.barrier()
        start = time.perf_counter()
        with ap.parallel_guard(["data"]):
            loss = F.mse_loss(m(paddle.to_tensor(x)), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        opt.clear_grad()
        float(loss)
        if k >= 3:
            times.append(time.perf_counter() - start)
    return {"step_s": float(np.median(times)), "checks_per_step": (agreement.stats()["checks"] - checks) / (steps + 3)}


def main():
    dist.init_parallel_env()
    rank = dist.get_rank()
    repeat, steps = int(sys.argv[1]), int(sys.argv[2])
    t = RealTransport(rank, "gloo")
    calls = {}
    for numel in (1, 16384, 1 << 20):
        for check in ("off", "on"):
            os.environ["AP_COLLECTIVE_CHECK"] = check
            calls[f"{numel * 4} B check {check}"] = per_call(t, rank, numel, repeat if numel < 1 << 20 else 20)
        os.environ["AP_COLLECTIVE_CHECK"] = "off"
        for log in (False, True):               # the collective log (on by default): noted, nothing sent
            transport._LOG_ON[0] = log
            calls[f"{numel * 4} B log {'on' if log else 'off'}"] = per_call(t, rank, numel,
                                                                           repeat if numel < 1 << 20 else 20)
        transport._LOG_ON[0] = None
    runs = {f"settle {a} check {b}": step_time(rank, steps, a, b) for a in ("off", "on") for b in ("off", "on")}
    write_result({"calls": calls, "steps": runs})


if __name__ == "__main__":
    main()
