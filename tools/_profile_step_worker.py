"""One launch of tools/profile_step.py: the GPT of tools/bench_vs_paddle.py under ap.parallelize(dp, tp),
warmed up, then ``--steps`` training steps each profiled with ap.profile (a barrier before each, outside the
region), the forward alone profiled, the forward timed with and without the profile (its own cost), and
optionally cProfile over one forward + backward on every rank (rank 0 reports its top functions).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import paddle                                             # noqa: E402
import paddle.distributed as dist                         # noqa: E402
import paddle.nn.functional as F                          # noqa: E402

from _bench_dispatch_worker import adamw, build_model, make_batch  # noqa: E402
from autoparallel.testing.launch import write_result     # noqa: E402


def setup(args):
    import autoparallel as ap

    model = build_model(args)
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = args.dp, args.tp
    model, opt = ap.parallelize(model, adamw(args, model.parameters()), strategy=s)
    ids, labels = (paddle.to_tensor(a) for a in make_batch(args))
    return model, opt, ids, labels


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    for name, default in (("vocab", 1024), ("hidden", 256), ("layers", 4), ("heads", 8), ("seq", 128),
                          ("batch", 8), ("seed", 0), ("warmup", 3), ("steps", 3), ("cprofile", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    dist.init_parallel_env()
    import autoparallel as ap

    model, opt, ids, labels = setup(args)
    forward = lambda: F.cross_entropy(model(ids), labels)              # noqa: E731

    def step():
        forward().backward()
        opt.step()
        opt.clear_grad()

    for _ in range(args.warmup):
        step()
    profiles = []
    for _ in range(args.steps):
        dist.barrier()
        with ap.profile() as prof:
            step()
        profiles.append(prof)
    slowest = [max(b.step_s for b in q.breakdowns.values()) for q in profiles]
    median = profiles[slowest.index(sorted(slowest)[len(slowest) // 2])]
    dist.barrier()
    with ap.profile() as fwd:
        loss = forward()
    loss.backward()
    opt.clear_grad()
    plain, hooked = [], []
    for _ in range(3):                                   # the profile's own cost on a forward
        for out, ctx in ((plain, None), (hooked, True)):
            dist.barrier()
            start = time.perf_counter()
            if ctx:
                q = ap.profile(gather=False).start()
            loss = forward()
            if ctx:
                q.stop()
            out.append(time.perf_counter() - start)
            loss.backward()
            opt.clear_grad()
    top = ""
    if args.cprofile:
        dist.barrier()
        pr = cProfile.Profile()
        pr.enable()
        forward().backward()
        pr.disable()
        opt.clear_grad()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(args.cprofile)
        top = buf.getvalue()
    if args.plot and dist.get_rank() == 0:
        median.plot(args.plot)
    write_result({"step": median.to_dict(), "step_table": median.table(), "forward": fwd.to_dict(),
                  "forward_table": fwd.table(), "forward_plain_s": statistics.median(plain),
                  "forward_profiled_s": statistics.median(hooked), "cprofile": top,
                  "step_times": slowest})


if __name__ == "__main__":
    main()
