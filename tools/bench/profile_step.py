"""Where a training step goes: ap.profile of the GPT of tools/bench/vs_paddle.py on real gloo ranks.

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench profile-step --dp 2 --tp 2 [--steps 3] [--cprofile 30]
                                                              [--plot docs/img/profile_gpt_dp2tp2.png]

Launches dp x tp ranks; each warms up, then profiles ``--steps`` steps (a barrier before each); prints their
mean per-rank breakdown (``--stat median``: per rank its step of median time), the forward's breakdown
(dispatched ops, dispatch overhead per op), the profile's own cost on a forward (median forward time inside and
outside a profile) and, with ``--cprofile N``, rank 0's top N functions by own time over ``--repeat`` forwards.
``--model tiny`` runs the calibration's replicated one-block model instead (the per-op costs of
docs/planner_predict.md), on dp x tp ranks; ``--model pf-llama`` PaddleFormers' Llama (intermediate 4 x hidden).
Each rank's CPU time per profiled step is printed beside the wall time; ``--categories`` adds rank 0's CPU
time per step by category (C++ ops and autograd, collectives, autoparallel's Python, paddle's Python).
"""
from __future__ import annotations

import argparse
from tools.bench.common import GPT_ARGS, add_int_args, launch, tool


WORKER = tool("_profile_step_worker.py")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    add_int_args(p, GPT_ARGS + (("warmup", 3), ("steps", 3), ("cprofile", 0), ("repeat", 1)))
    p.add_argument("--plot", default=None, help="write the summary step's stacked bars here (PNG)")
    p.add_argument("--stat", choices=("mean", "median"), default="mean",
                   help="summarise the profiled steps by their mean, or per rank by the step of median time")
    p.add_argument("--model", choices=("gpt", "tiny", "pf-llama"), default="gpt",
                   help="gpt: the bench GPT; tiny: the calibration's replicated one-block model (per-op costs); "
                        "pf-llama: PaddleFormers' Llama")
    p.add_argument("--categories", action="store_true", help="rank 0's CPU time per step by category")
    return p


def check_args(p, args) -> None:
    """Refuse, before the launch, values the run cannot use and options it would ignore."""
    if args.dp < 1 or args.tp < 1 or args.steps < 1 or args.warmup < 0:
        p.error(f"--dp, --tp and --steps must be positive and --warmup >= 0, got {args.dp}, {args.tp}, {args.steps}, "
                f"{args.warmup}")
    if args.repeat != 1 and not args.cprofile:
        p.error(f"--repeat {args.repeat} sets the forwards of --cprofile N, which is off")
    sizes = [f"--{k}" for k, _ in GPT_ARGS if getattr(args, k) != p.get_default(k)]
    if args.model == "tiny" and sizes:
        p.error(f"--model tiny is the calibration's fixed one-block model: {', '.join(sizes)} do not apply to it")


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    flags = [x for k, v in vars(args).items() if v is not None and v is not False
             for x in ((f"--{k}",) if v is True else (f"--{k}", str(v)))]
    res = launch(WORKER, args.dp * args.tp, flags, timeout=900)[0]
    if args.model == "tiny":
        print(f"the calibration's one-block model (d 16, batch [2, 8]) replicated on {args.dp * args.tp} gloo ranks")
    else:
        print(f"{'GPT' if args.model == 'gpt' else 'PaddleFormers Llama'} vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, {args.heads} heads, seq {args.seq}, "
              f"global batch {args.batch}; DP{args.dp} x TP{args.tp} on {args.dp * args.tp} gloo ranks")
    print(f"profiled steps (slowest rank, ms): {', '.join(f'{t * 1e3:.0f}' for t in res['step_times'])}")
    print("CPU time per profiled step, per rank (ms, median): "
          + ", ".join(f"{c * 1e3:.0f}" for c in res["cpu_by_rank"]))
    print(f"\n== training step ({args.stat} of {args.steps}) ==\n" + res["step_table"])
    if res["categories"]:
        cats = sorted(res["categories"].items(), key=lambda kv: -kv[1])
        total = sum(v for _, v in cats)
        print(f"\n== rank 0, CPU per step by category (cProfile on process time, {total * 1e3:.0f} ms) ==")
        for k, v in cats:
            print(f"  {v * 1e3:8.1f} ms  {v / total:5.1%}  {k}")
    print(f"\n== forward only ({args.stat} of {args.steps}) ==\n" + res["forward_table"])
    plain, hooked = res["forward_plain_s"], res["forward_profiled_s"]
    print(f"\nforward without / inside ap.profile (rank 0, median of 5): {plain * 1e3:.1f} / {hooked * 1e3:.1f} ms")
    pvd = res["plain_vs_dispatched"]
    if pvd:
        n = pvd["ops"]
        print(f"forward on plain tensors / on DistTensors (every rank busy, medians of 20): {pvd['plain'] * 1e3:.2f} / "
              f"{pvd['dispatched'] * 1e3:.2f} ms = {pvd['plain'] / n * 1e6:.1f} / {pvd['dispatched'] / n * 1e6:.1f} us "
              f"per dispatched op ({n} ops); dispatch adds {(pvd['dispatched'] - pvd['plain']) / n * 1e6:.1f} us per op")
    if res["cprofile"]:
        print(f"\n== rank 0, cProfile of {args.repeat} forward(s) ==\n" + res["cprofile"])
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
