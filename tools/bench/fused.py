"""Fused projections on real gloo ranks: PaddleFormers Phi3 under ap.parallelize (dp x tp), the default
block-sharded plan for its fused [gate | up] and [q | k | v] against the same projections column-split with
their output gathered (the plan before block sharding), alternated in one job (the order swapped every round).

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench fused [--dp 2 --tp 2 --hidden 256 --layers 4 --seq 128]

Prints per plan the median step time (slowest rank), the collectives per step on the TP groups, and the loss of
the first step (both plans compute the same model).
"""
from __future__ import annotations

import argparse
import os

from autoparallel.testing.launch import launch

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_bench_fused_worker.py")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("dp", 2), ("tp", 2), ("vocab", 1024), ("hidden", 256), ("layers", 4), ("heads", 8),
                          ("kv_heads", 4), ("seq", 128), ("batch", 8), ("warmup", 2), ("rounds", 5)):
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=default)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if min(args.dp, args.tp, args.rounds, args.layers, args.batch) < 1 or args.warmup < 0 or args.batch % args.dp:
        p.error(f"expected --dp, --tp, --rounds, --layers, --batch >= 1, --warmup >= 0 and --batch a multiple of "
                f"--dp, got {args.dp}, {args.tp}, {args.rounds}, {args.layers}, {args.batch}, {args.warmup}")
    flags = [x for k, v in vars(args).items() for x in (f"--{k}", str(v))]
    res = launch(WORKER, args.dp * args.tp, flags, timeout=1200)[0]
    print(f"Phi3 vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
          f"({args.kv_heads} kv), seq {args.seq}, global batch {args.batch}; DP{args.dp} x TP{args.tp} on "
          f"{args.dp * args.tp} gloo ranks, {args.rounds} alternated rounds after {args.warmup} warm-up steps each")
    print("| plan | step ms (median, slowest rank) | TP-group collectives per step | first loss |")
    print("|---|---|---|---|")
    for name in ("blocked", "gathered"):
        r = res[name]
        comm = ", ".join(f"{k} {v}" for k, v in sorted(r["comm"].items()))
        print(f"| {name} | {r['median_ms']:.0f} | {comm} | {r['loss']:.6f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
