"""Where a training step goes: ap.profile of the GPT of tools/bench_vs_paddle.py on real gloo ranks.

    OMP_NUM_THREADS=1 .venv/bin/python tools/profile_step.py --dp 2 --tp 2 [--steps 3] [--cprofile 30]
                                                              [--plot docs/img/profile_gpt_dp2tp2.png]

Launches dp x tp ranks; each warms up, then profiles ``--steps`` steps (a barrier before each) and keeps the
step whose slowest rank is the median; prints that step's per-rank breakdown, the forward's breakdown
(dispatched ops, dispatch overhead per op), the profile's own cost on a forward (median forward time with and
without it) and, with ``--cprofile N``, rank 0's top N functions by own time over one forward + backward.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from autoparallel.testing.launch import launch           # noqa: E402

WORKER = os.path.join(HERE, "_profile_step_worker.py")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    for name, default in (("vocab", 1024), ("hidden", 256), ("layers", 4), ("heads", 8), ("seq", 128),
                          ("batch", 8), ("warmup", 3), ("steps", 3), ("cprofile", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--plot", default=None, help="write the median step's stacked bars here (PNG)")
    args = p.parse_args(argv)
    if args.dp < 1 or args.tp < 1 or args.steps < 1:
        raise SystemExit(f"--dp, --tp and --steps must be positive, got {args.dp}, {args.tp}, {args.steps}")
    flags = [x for k, v in vars(args).items() if v is not None for x in (f"--{k}", str(v))]
    res = launch(WORKER, args.dp * args.tp, flags, timeout=900)[0]
    print(f"GPT vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, {args.heads} heads, seq {args.seq}, "
          f"global batch {args.batch}; DP{args.dp} x TP{args.tp} on {args.dp * args.tp} gloo ranks")
    print(f"profiled steps (slowest rank, ms): {', '.join(f'{t * 1e3:.0f}' for t in res['step_times'])}")
    print("\n== median step ==\n" + res["step_table"])
    print("\n== forward only ==\n" + res["forward_table"])
    plain, hooked = res["forward_plain_s"], res["forward_profiled_s"]
    print(f"\nforward without / with ap.profile (rank 0, median of 3): {plain * 1e3:.1f} / {hooked * 1e3:.1f} ms")
    if res["cprofile"]:
        print("\n== rank 0, cProfile of one forward + backward ==\n" + res["cprofile"])
    if args.plot:
        print(f"plot: {args.plot}")
    return res


if __name__ == "__main__":
    main()
