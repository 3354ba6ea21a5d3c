"""Runs on every rank (4): the tiny GPT under data parallel with gradient reductions launched from backward
hooks, counting the collectives of every micro-step's backward and of every optimizer step; one launch.

    reducer_worker.py OUT_DIR BUCKET_BYTES
Rank 0 saves each config's gathered final parameters to OUT_DIR/<name>.npz; every rank reports losses,
collective names per backward / step, the Reducer's launches and its number of buckets.
"""
import contextlib
import os
import sys
from unittest import mock

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F


import autoparallel as ap  # noqa: E402
from autoparallel import layer_state  # noqa: E402
from autoparallel.comm.counter import count_comm  # noqa: E402
from autoparallel.comm.groups import install_group_store_fix  # noqa: E402
from autoparallel.parallel.grads import GradientSync  # noqa: E402
from autoparallel.parallel.sharding import apply_zero  # noqa: E402
from autoparallel.parallelize import parallelize  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402
from zero_common import batches, make_opt, tiny  # noqa: E402

STEPS = 4
# name: (dp, tp, gradient accumulation, ZeRO stage, options)
CONFIGS = {
    "dp4": (4, 1, 1, None, {}),
    "dp4_async": (4, 1, 1, None, {"async_op": True}),          # sync_op=False (blocks on gloo)
    "dp4_step_time": (4, 1, 1, None, {"overlap": False}),
    "dp2tp2_ga2": (2, 2, 2, None, {}),
    "dp2tp2_ga2_step_time": (2, 2, 2, None, {"overlap": False}),
    "dp4_ga2_expect1": (4, 1, 2, None, {"expect": 1}),          # told 1 backward per step, given 2
    "neg_no_partial": (4, 1, 2, None, {"expect": 1, "no_partial": True}),
    "zero2": (4, 1, 1, 2, {}),
    "zero3": (4, 1, 1, 3, {}),
}


def strategy(dp, tp, ga):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree, s.gradient_accumulation_steps = dp, tp, ga
    return s


def build(dp, tp, ga, stage, opts, bucket_bytes):
    m = tiny()
    m, opt = parallelize(m, make_opt(m), strategy=strategy(dp, tp, ga))
    if stage is not None:
        return m, apply_zero(m, opt, layer_state.mesh_of(m), stage, bucket_bytes=bucket_bytes)
    opt.bucket_bytes = bucket_bytes
    opt.grad_sync.overlap = opts.get("overlap", True)
    opt.grad_sync.async_op = opts.get("async_op")
    return m, opt


def reducer_of(opt):
    return opt.reducer if hasattr(opt, "stage") else opt.grad_sync.reducer


def run(name, dp, tp, ga, stage, opts, bucket_bytes, out_dir, rank):
    # negative control (bound when the buckets are planned, at the first step): a late gradient adds onto the
    # reduced value
    no_partial = mock.patch.object(GradientSync, "_to_partial", lambda self, p: None)
    with no_partial if opts.get("no_partial") else contextlib.nullcontext():
        return train(name, dp, tp, ga, stage, opts, bucket_bytes, out_dir, rank)


def train(name, dp, tp, ga, stage, opts, bucket_bytes, out_dir, rank):
    m, opt = build(dp, tp, ga, stage, opts, bucket_bytes)
    data = batches(STEPS * ga)
    losses, steps = [], []
    for i in range(STEPS):
        red = reducer_of(opt)
        if red is not None and "expect" in opts:
            red.expected = dict.fromkeys(red.expected, opts["expect"])
        backward, total = [], 0.0
        for j in range(ga):
            x, y = data[i * ga + j]
            loss = F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y))
            with count_comm() as log:
                loss.backward()
            backward.append([c[0] for c in log.calls])
            total += float(loss) / ga
        launches = [list(l) for l in red.launches] if red is not None else []
        with count_comm() as log:
            opt.step()
        opt.clear_grad()
        losses.append(total)
        steps.append({"backward": backward, "step": [c[0] for c in log.calls], "launches": launches})
    red = reducer_of(opt)
    if stage == 3:
        opt.gather(opt.params)
    params = {n: p.full().numpy() for n, p in m.named_parameters()}
    if rank == 0:
        np.savez(os.path.join(out_dir, name + ".npz"), **params)
    return {"losses": losses, "steps": steps, "buckets": len(red.buckets) if red is not None else None}


def main():
    out_dir, bucket_bytes = sys.argv[1], int(sys.argv[2])
    dist.init_parallel_env()
    install_group_store_fix()
    rank = dist.get_rank()
    res = {"rank": rank, "configs": {}}
    for name, cfg in CONFIGS.items():
        res["configs"][name] = run(name, *cfg, bucket_bytes, out_dir, rank)
    write_result(res)


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
