#!/usr/bin/env python
"""Compare the per-step losses of two training logs (examples/train_*.py --log-json).

    python tools/compare_logs.py out/single.json out/dp2tp2.json [--rtol 1e-4]

Prints both loss curves side by side and exits non-zero if any step differs beyond the tolerance.
"""
import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reference")
    p.add_argument("other")
    p.add_argument("--rtol", type=float, default=1e-4)
    args = p.parse_args(argv)
    logs = []
    for path in (args.reference, args.other):
        with open(path) as f:
            logs.append(json.load(f))
    a, b = ([s["loss"] for s in log["steps"]] for log in logs)
    if len(a) != len(b):
        print(f"the logs have {len(a)} and {len(b)} steps; expected the same number", file=sys.stderr)
        return 2
    worst = 0.0
    print(f"{'step':>4}  {'reference':>10}  {'other':>10}  rel. diff")
    for i, (x, y) in enumerate(zip(a, b)):
        rel = abs(x - y) / max(abs(x), 1e-12)
        worst = max(worst, rel)
        print(f"{i:>4}  {x:10.6f}  {y:10.6f}  {rel:.1e}")
    ok = worst <= args.rtol
    ranks = logs[1].get("world_size", "?")
    print(f"{ranks} ranks vs one process: largest relative loss difference {worst:.1e} "
          f"({'within' if ok else 'OUTSIDE'} rtol {args.rtol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
