"""Runs on every rank: several training jobs of examples/train_common.py in one launch.

    train_worker.py OUT_DIR JOBS_JSON
    JOBS_JSON: [{"name": ..., "argv": [train flags], "negative": null | "wrong_batch" | "no_reduce",
                 "probe": null | "forward_comm" | "accumulation_comm"}, ...]

Rank 0 saves each job's gathered final parameters to OUT_DIR/<name>.npz; every rank reports its losses,
mesh, node (POD_NAME) and probe results through write_result.
"""
import contextlib
import json
import os

import sys
from unittest import mock

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F


import train_common  # noqa: E402

import autoparallel.data as ap_data  # noqa: E402
from autoparallel import layer_state  # noqa: E402
from autoparallel.comm.counter import count_comm  # noqa: E402
from autoparallel.comm.groups import install_group_store_fix  # noqa: E402
from autoparallel.dist_tensor import is_dist  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402
from autoparallel.testing.negative import no_gradient_reduction  # noqa: E402


def negative(kind):
    """Deliberate mistakes that must make the comparison with the single process fail."""
    if kind == "wrong_batch":              # every rank loads data-parallel shard 0
        saved = ap_data.data_rank
        return mock.patch.object(ap_data, "data_rank", lambda mesh, rank, dims: (saved(mesh, rank, dims)[0], 0))
    if kind == "no_reduce":                # partial gradients never reduced over the data axis
        return no_gradient_reduction()
    return contextlib.nullcontext()


def one_batch(model, args, k=1):
    loader = ap_data.DistributedDataLoader(ap_data.ByteTextDataset(args.seq_len), args.batch_size,
                                           mesh=layer_state.mesh_of(model), num_micro_batches=k, seed=args.seed + 1)
    return iter(loader)


def forward_comm(model, args):
    """Collectives issued inside each layer's forward (hooks bracket the layer, its own hooks included)."""
    x, _ = next(one_batch(model, args))
    marks = []
    for name, layer in model.named_sublayers():
        if not name or list(layer.children()):
            continue
        layer.register_forward_pre_hook(lambda l, i, n=name: marks.append((n, "in", len(log.calls))), prepend=True)
        layer.register_forward_post_hook(lambda l, i, o, n=name: marks.append((n, "out", len(log.calls))))
    with count_comm() as log:
        model(x)
    per_layer, start, inside = {}, {}, set()
    for n, what, at in marks:
        if what == "in":
            start[n] = at
        else:
            calls = [c[0] for c in log.calls[start[n]:at]]
            inside.update(range(start[n], at))
            per_layer.setdefault(n, []).append(calls)
    outside = [log.calls[i][0] for i in range(len(log.calls)) if i not in inside]
    return {"per_layer": {n: v[0] for n, v in per_layer.items()}, "outside": outside,
            "total": log.summary()}


def accumulation_comm(model, opt, args, k):
    """Collectives of each micro-step's backward and of the optimizer step under gradient accumulation."""
    it = one_batch(model, args, k)
    backward = []
    for _ in range(k):
        x, y = next(it)
        loss = F.cross_entropy(model(x), y)
        with count_comm() as log:
            loss.backward()
        backward.append(log.calls)
    with count_comm() as log:
        opt.step()
    opt.clear_grad()
    return {"backward": [[c[0] for c in calls] for calls in backward], "step": [c[0] for c in log.calls],
            "backward_bytes": [sum(c[1] for c in calls) for calls in backward], "step_bytes": log.bytes_sent}


def run_job(job, out_dir, rank):
    args = train_common.make_parser(job.get("model", "gpt-tiny")).parse_args(job["argv"])
    with negative(job.get("negative")):
        log, model, opt = train_common.train(args)
    params = {n: (p.full() if is_dist(p) else p).numpy() for n, p in model.named_parameters()}
    if rank == 0:
        np.savez(os.path.join(out_dir, job["name"] + ".npz"), **params)
    res = {"losses": [s["loss"] for s in log["steps"]], "times": [s["time"] for s in log["steps"]],
           "mesh": log["mesh"], "memory": log["memory_per_rank"]}
    if job.get("probe") == "forward_comm":
        res["probe"] = forward_comm(model, args)
    elif job.get("probe") == "accumulation_comm":
        res["probe"] = accumulation_comm(model, opt, args, args.grad_accum)
    return res


def main():
    out_dir, jobs = sys.argv[1], json.loads(sys.argv[2])
    dist.init_parallel_env()
    install_group_store_fix()
    rank = dist.get_rank()
    out = {"rank": rank, "pod": os.environ.get("POD_NAME"), "jobs": {}}
    for job in jobs:                       # an exception ends the rank: launch() reports every rank's log
        out["jobs"][job["name"]] = run_job(job, out_dir, rank)
    write_result(out)


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
