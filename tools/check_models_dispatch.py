#!/usr/bin/env python
"""Every tiny PaddleFormers causal LM under plain DP and the seed shard function in the simulated 4-rank
world, against one process: prints the markdown table of docs/dispatch_real_models.md.

    OMP_NUM_THREADS=1 PYTHONPATH=. python tools/check_models_dispatch.py [--models llama,qwen2_moe]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

import autoparallel as ap  # noqa: E402
from autoparallel.testing import paddleformers_models as pf  # noqa: E402


def row(name, mode, ref):
    try:
        with ap.simulate(world_size=4):
            got = pf.sharded(name, mode)
    except Exception as e:  # a failure is a row of the table, not the end of the run
        return f"| {name} | {mode} | {ref[0]:.6f} | | | {len(ref[1])} | FAIL {type(e).__name__}: {str(e)[:80]} |"
    bad = pf.compare(ref, got)
    err = max(float(np.max(np.abs(got[1][k] - g))) for k, g in ref[1].items())
    verdict = "equal" if not bad else f"DIFFERS: {', '.join(bad[:3])}"
    return f"| {name} | {mode} | {ref[0]:.6f} | {got[0]:.6f} | {err:.1e} | {len(ref[1])} | {verdict} |"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(pf.MODELS), help="comma-separated names of pf.MODELS")
    args = p.parse_args(argv)
    if not pf.available():
        print("PaddleFormers is not installed (pip install -e .[models])", file=sys.stderr)
        return 2
    print("| model | mode | loss, one process | loss, sharded | max abs gradient error | parameters | result |")
    print("|---|---|---|---|---|---|---|")
    failed = 0
    for name in args.models.split(","):
        ref = pf.reference(name)
        for mode in ("dp", "tp"):
            line = row(name, mode, ref)
            failed += "| equal |" not in line
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
