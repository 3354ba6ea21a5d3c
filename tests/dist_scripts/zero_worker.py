"""Runs on every rank (4): DP4 and ZeRO-1/2/3/3+offload on the tiny GPT, a negative control, global-norm
clipping under ZeRO, and AMP with an overflow on one rank only; one launch.

    zero_worker.py OUT_DIR
Rank 0 saves each config's gathered final parameters to OUT_DIR/<name>.npz; every rank reports losses,
bytes of params/grads/optimizer states, step times and probes through write_result.
"""
import contextlib
import os
import sys
import time
from unittest import mock

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F


import autoparallel as ap  # noqa: E402
from autoparallel import layer_state  # noqa: E402
from autoparallel.comm import collectives as C  # noqa: E402
from autoparallel.parallel import amp  # noqa: E402
from autoparallel.parallel.optim_clone import state_tensors  # noqa: E402
from autoparallel.memory import live_bytes  # noqa: E402
from autoparallel.parallel.sharding import apply_zero  # noqa: E402
from autoparallel.parallelize import parallelize  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402
from zero_common import batches, make_opt, tiny  # noqa: E402

CONFIGS = [("dp4", None, False, None, None), ("zero1", 1, False, None, None), ("zero2", 2, False, None, None),
           ("zero3", 3, False, None, None), ("zero3_offload", 3, True, None, None),
           ("neg_zero2_no_reduce", 2, False, None, "no_reduce"), ("zero3_clip", 3, False, 0.5, None),
           ("zero2_hsdp2", 2, False, None, "hsdp")]


def negative(kind):
    if kind == "no_reduce":                 # each rank keeps its own partial gradient chunk
        return mock.patch.object(C, "_reduce_scatter_raw",
                                 lambda xs, ranks, axis, sizes, op: C._slice_raw(xs, ranks, axis, sizes))
    return contextlib.nullcontext()


def strategy():
    s = ap.Strategy()
    s.data_parallel.degree = 4
    return s


def dp_bytes(model, opt):
    params = list(model.parameters())
    return {"params": live_bytes(params), "grads": live_bytes([p.grad for p in params]),
            "optimizer_states": live_bytes(state_tensors(opt._inner))}


def run(name, stage, offload, clip, neg, out_dir, rank):
    m = tiny()
    m, opt = parallelize(m, make_opt(m, clip), strategy=strategy())
    if stage is not None:
        opt = apply_zero(m, opt, layer_state.mesh_of(m), stage, offload=offload, degree=2 if neg == "hsdp" else None)
    losses, times, mem, probe = [], [], None, {}
    with negative(neg):
        for i, (x, y) in enumerate(batches()):
            t0 = time.perf_counter()
            out = m(paddle.to_tensor(x))
            if stage == 3 and i == 0:       # after the forward: every parameter released again
                probe["freed_after_forward"] = all(not p._is_initialized() for p in m.parameters())
            loss = F.cross_entropy(out, paddle.to_tensor(y))
            loss.backward()
            opt.step()
            mem = opt.memory_bytes() if stage is not None else dp_bytes(m, opt)
            opt.clear_grad()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
    if stage == 3:
        probe["freed_after_step"] = all(not p._is_initialized() for p in m.parameters())
        probe["state_places_cpu"] = all(pl.is_cpu_place() for pl in opt.state_places())
        opt.gather(opt.params)
    params = {n: p.full().numpy() for n, p in m.named_parameters()}
    if rank == 0:
        np.savez(os.path.join(out_dir, name + ".npz"), **params)
    return {"losses": losses, "times": times, "memory": mem, "probe": probe}


def amp_one_rank_overflow(rank):
    """fp16 emulated AMP on DP4: rank 2 alone gets an inf gradient at step 1; every rank must skip it."""
    m = tiny()
    m, opt = parallelize(m, make_opt(m), strategy=strategy())
    amp.apply_amp(m, "float16")
    aopt = amp.AmpOptimizer(opt, amp.LossScaler(2.0**10, decr_every_n_nan_or_inf=1, incr_every_n_steps=2),
                            mesh=layer_state.mesh_of(m))
    rec = []
    for i, (x, y) in enumerate(batches(4)):
        loss = F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y))
        aopt.scale(loss).backward()
        if i == 1 and rank == 2:
            p = m.blocks[0].mlp.fc1.weight
            g = p.grad.numpy()
            g[0, 0] = np.inf
            p.grad.set_value(paddle.to_tensor(g))
        before = m.ln_f.weight.numpy().copy()
        scale = aopt.scaler.scale_value
        ran = aopt.step()
        changed = bool(np.any(m.ln_f.weight.numpy() != before))
        aopt.clear_grad()
        rec.append({"ran": ran, "changed": changed, "scale_before": scale, "scale_after": aopt.scaler.scale_value,
                    "loss": float(loss)})
    dtypes = sorted({str(p.dtype) for p in m.parameters()})
    return {"steps": rec, "param_dtypes": dtypes}


def main():
    out_dir = sys.argv[1]
    dist.init_parallel_env()
    rank = dist.get_rank()
    res = {"rank": rank, "configs": {}}
    for cfg in CONFIGS:
        res["configs"][cfg[0]] = run(*cfg, out_dir, rank)
    res["amp"] = amp_one_rank_overflow(rank)
    write_result(res)


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
