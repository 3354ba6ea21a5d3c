"""Runs on every rank: the tiny GPT (and LLaMA) trained eagerly (ap.parallelize) and captured (ap.to_static) from
the same initialisation on the same batches, plus a negative control; reports losses, final parameters (rank 0
saves them as OUT_DIR/<model>_<eager|static|negative>.npz), collectives per step and step times.

    static_gpt.py OUT_DIR [--dp 2 --tp 2 --steps 3 --models gpt,llama --negative 1]
"""
import argparse
import contextlib
import os
import time

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F


import autoparallel as ap  # noqa: E402
from autoparallel.comm.counter import count_comm  # noqa: E402
from autoparallel.dist_tensor import is_dist  # noqa: E402
from autoparallel.graph.to_static import to_static  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402
from autoparallel.testing.negative import no_gradient_reduction  # noqa: E402
from autoparallel.testing.models import build  # noqa: E402


class Batches(paddle.io.Dataset):
    """Fixed random token windows: item i is (ids, next ids)."""

    def __init__(self, n=64, t=8, vocab=64, seed=0):
        rng = np.random.default_rng(seed)
        self.data = rng.integers(0, vocab, (n, t + 1)).astype("int64")

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


def loss_fn(logits, labels):
    return F.cross_entropy(logits, labels)


def strategy(dp, tp):
    s = ap.Strategy()
    s.data_parallel.degree = dp
    s.tensor_parallel.degree = tp
    return s


def params_of(model):
    return {n: (p.full() if is_dist(p) else p).numpy() for n, p in model.named_parameters()}


def no_reduce():
    """Negative control: partial gradients are never reduced over the data axis."""
    return no_gradient_reduction()


def run_eager(args, loader):
    model = build(args.model, seed=0)
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    model, opt = ap.parallelize(model, opt, strategy=strategy(args.dp, args.tp))
    losses, times, comm = [], [], None
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        t0 = time.perf_counter()
        with count_comm() as log:
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
        times.append(time.perf_counter() - t0)
        comm = log.summary()
    return losses, params_of(model), times, comm


def run_static(args, loader, negative=False):
    model = build(args.model, seed=0)
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    t0 = time.perf_counter()
    dm = to_static(model, loader, loss_fn, opt, strategy=strategy(args.dp, args.tp))
    capture_s = time.perf_counter() - t0
    losses, times, comm = [], [], None
    ctx = no_reduce() if negative else contextlib.nullcontext()
    with ctx:
        for step, batch in enumerate(loader):
            if step == args.steps:
                break
            t0 = time.perf_counter()
            with count_comm() as log:
                losses.append(dm.train_step(batch))
            times.append(time.perf_counter() - t0)
            comm = log.summary()
    return losses, params_of(model), times, comm, capture_s, dm.listing()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--models", default="gpt")
    p.add_argument("--negative", type=int, default=1, help="also run the negative control (first model only)")
    args = p.parse_args()
    dist.init_parallel_env()
    rank = dist.get_rank()
    loader = paddle.io.DataLoader(Batches(), batch_size=4, shuffle=False)
    result = {}
    for i, name in enumerate(args.models.split(",")):
        args.model = name
        e_losses, e_params, e_times, e_comm = run_eager(args, loader)
        s_losses, s_params, s_times, s_comm, capture_s, listing = run_static(args, loader)
        out = {"eager": e_losses, "static": s_losses, "eager_times": e_times, "static_times": s_times,
               "eager_comm": e_comm, "static_comm": s_comm, "capture_s": capture_s}
        saved = {"eager": e_params, "static": s_params}
        if args.negative and i == 0:
            n_losses, saved["negative"], *_ = run_static(args, loader, negative=True)
            out["negative"] = n_losses
        if rank == 0:
            for kind, params in saved.items():
                np.savez(os.path.join(args.out, f"{name}_{kind}.npz"), **params)
            with open(os.path.join(args.out, f"{name}_listing.txt"), "w") as f:
                f.write(listing)
        result[name] = out
    write_result(result)


if __name__ == "__main__":
    main()
