"""One launch of tools/bench/profile_step.py: the GPT of tools/bench/vs_paddle.py under ap.parallelize(dp, tp),
warmed up, then ``--steps`` training steps each profiled with ap.profile (a barrier before each, outside the
region), the forward alone profiled, the forward timed with and without the profile (its own cost), and
optionally cProfile over ``--repeat`` forwards on every rank (rank 0 reports its top functions). Each
profiled step's CPU time (``time.process_time``) is gathered per rank; ``--categories`` runs a CPU-time
cProfile of ``--steps`` whole steps and returns rank 0's CPU per step by category (paddle's C++ ops and
autograd, the ``paddle.distributed`` collectives, autoparallel's Python, paddle's Python, the rest).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time


import paddle                                             # noqa: E402
import paddle.distributed as dist                         # noqa: E402
import paddle.nn.functional as F                          # noqa: E402

from _bench_dispatch_worker import adamw, make_batch     # noqa: E402
from _bench_vs_paddle_worker import build_model           # noqa: E402 (the GPT, or PaddleFormers' Llama)
from autoparallel.profiler import averaged               # noqa: E402
from autoparallel.testing.launch import write_result     # noqa: E402
from tools.bench.common import GPT_ARGS, add_int_args


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
    add_int_args(p, GPT_ARGS + (("seed", 0), ("warmup", 3), ("steps", 3), ("cprofile", 0), ("repeat", 1)))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--plot", default=None)
    p.add_argument("--model", choices=("gpt", "tiny", "pf-llama"), default="gpt")
    p.add_argument("--categories", action="store_true")
    p.add_argument("--stat", choices=("mean", "median"), default="mean")
    args = p.parse_args()
    dist.init_parallel_env()
    import autoparallel as ap

    if args.model == "tiny":        # the calibration's replicated one-block model (planner/calib_worker.py)
        from autoparallel.planner.calib_worker import _replicated_lm

        model, opt, ids, forward = _replicated_lm(dist.get_world_size())
    elif args.model == "pf-llama":
        from autoparallel.testing.paddleformers_models import loss_of

        model, opt, ids, labels = setup(args)
        forward = lambda: loss_of(model(input_ids=ids, labels=labels))  # noqa: E731
    else:
        model, opt, ids, labels = setup(args)
        forward = lambda: F.cross_entropy(model(ids), labels)          # noqa: E731

    def step():
        forward().backward()
        opt.step()
        opt.clear_grad()

    for _ in range(args.warmup):
        step()
    with ap.profile():                                   # the first profile imports its modules: not counted
        step()
    profiles, cpu = [], []
    for _ in range(args.steps):
        dist.barrier()
        c = time.process_time()
        with ap.profile() as prof:
            step()
        cpu.append(time.process_time() - c)
        profiles.append(prof)
    cpu_by_rank = []
    dist.all_gather_object(cpu_by_rank, statistics.median(cpu))
    slowest = [max(b.step_s for b in q.breakdowns.values()) for q in profiles]
    mean = averaged(profiles, args.stat)
    fwds = []
    for _ in range(args.steps):
        dist.barrier()
        with ap.profile() as fwd:
            loss = forward()
        loss.backward()
        opt.clear_grad()
        fwds.append(fwd)
    fwd = averaged(fwds, args.stat)
    plain, hooked = [], []
    for _ in range(5):                                   # the profile's own cost on a forward
        for out, ctx in ((plain, None), (hooked, True)):
            dist.barrier()
            q = ap.profile(gather=False).start() if ctx else None
            start = time.perf_counter()
            loss = forward()
            out.append(time.perf_counter() - start)
            if q is not None:
                q.stop()
            loss.backward()
            opt.clear_grad()
    top = ""
    if args.cprofile:
        dist.barrier()
        pr = cProfile.Profile()
        for _ in range(args.repeat):
            pr.enable()
            loss = forward()
            pr.disable()
            loss.backward()
            opt.clear_grad()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(args.cprofile)
        top = buf.getvalue()
    categories = cpu_categories(step, args.steps) if args.categories else None
    if args.plot and dist.get_rank() == 0:
        mean.plot(args.plot)
    write_result({"step": mean.to_dict(), "step_table": mean.table(), "forward": fwd.to_dict(),
                  "forward_table": fwd.table(), "forward_plain_s": statistics.median(plain),
                  "forward_profiled_s": statistics.median(hooked), "cprofile": top,
                  "step_times": slowest, "plain_vs_dispatched": plain_vs_dispatched(args, forward),
                  "cpu_by_rank": cpu_by_rank, "categories": categories})


def _category(fn: str, name: str) -> str:
    if fn == "~" and any(c in name for c in ("all_reduce", "all_gather", "broadcast", "send", "recv", "barrier")):
        return "collectives (paddle.distributed, C++)"
    if fn == "~":
        return "paddle C++ (ops, autograd) and builtins"
    if "/autoparallel/" in fn:
        return "autoparallel Python"
    if "site-packages/paddle" in fn:
        return "paddle Python"
    return "other Python"


def cpu_categories(step, n: int) -> dict:
    """CPU seconds per step by category (own time of each function, cProfile on ``time.process_time``)."""
    if dist.is_initialized():
        dist.barrier()
    pr = cProfile.Profile(time.process_time)
    for _ in range(n):
        pr.enable()
        step()
        pr.disable()
    out: dict = {}
    for (fn, _, name), (_, _, own, _, _) in pstats.Stats(pr).stats.items():
        k = _category(fn, name)
        out[k] = out.get(k, 0.0) + own / n
    return out


def plain_vs_dispatched(args, forward, repeat: int = 20):
    """The calibration model only: seconds of one forward of the same model on plain tensors and on
    DistTensors (alternated, every rank busy, medians) and its dispatched op count."""
    if args.model != "tiny":
        return None
    from autoparallel.planner.calib_worker import _count_dispatched, _tiny_lm

    paddle.seed(0)
    plain_model, vocab = _tiny_lm()
    ids = paddle.randint(0, vocab, [2, 8])
    labels = paddle.randint(0, vocab, [2, 8])
    plain = lambda: F.cross_entropy(plain_model(ids), labels)          # noqa: E731
    times = {"plain": [], "dispatched": []}
    for _ in range(repeat):
        for name, fn in (("plain", plain), ("dispatched", forward)):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()} | {"ops": _count_dispatched(forward)}


if __name__ == "__main__":
    main()
