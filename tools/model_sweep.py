"""Every PaddleFormers text causal-LM family, tiny config, against one process in the simulated 4-rank world.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m tools.model_sweep [--models llama,deepseek_v3] [--modes dp,tp]
                                                               [--no-variants] [--no-skips]

For each family of ``autoparallel.testing.paddleformers_models`` (default config and the config options in
``VARIANTS``): the loss and every gradient of one process vs plain DP (weights replicated), the seed shard
function (tp) and ``ap.parallelize`` dp=2 x tp=2, on a 2x2 ["data", "model"] mesh; parameters a model
initialises to zero (biases ...) get small random values (``pf.build(fill_zeros=True)``). Prints a markdown table,
one line per family and config, a column per mode: ok / DIFFERS (names) / the error type, with the max abs
gradient error; families that cannot run on a CPU are listed with their reason. Exit status 1 when a cell is
not ok.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from tqdm import tqdm

import autoparallel as ap
from autoparallel.testing import paddleformers_models as pf
from autoparallel.testing import paddleformers_runs as pc

MODES = ("dp", "tp", "parallelize")


def cases(models, variants: bool):
    """[(name, overrides)]: each family's default config, then its options."""
    out = []
    for name in models:
        out.append((name, {}))
        out += [(name, o) for o in (pf.VARIANTS.get(name, []) if variants else [])]
    return out


def run(name, mode, overrides):
    with ap.simulate(world_size=4):
        if mode == "parallelize":
            return pc.parallelize_grads(name, **overrides)
        return pf.sharded(name, mode, **overrides)


def cell(name, mode, overrides, ref):
    """(verdict, max abs gradient error or None)."""
    try:
        got = run(name, mode, overrides)
    except Exception as e:  # a failure is a cell of the table, not the end of the sweep
        return f"{type(e).__name__}: {str(e).splitlines()[0][:90]}", None
    err = max(float(np.max(np.abs(got[1][k] - g))) if k in got[1] else np.inf for k, g in ref[1].items())
    bad = pf.compare(ref, got)
    return ("ok" if not bad else f"DIFFERS ({', '.join(bad[:2])})"), err


def label(overrides) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items()) or "default"


def sweep(models, modes, variants: bool, fill_zeros: bool = True) -> list:
    rows = []
    for name, options in tqdm(cases(models, variants), desc="families", file=sys.stderr):
        overrides = {**options, "fill_zeros": fill_zeros}
        try:
            ref = pf.reference(name, **overrides)
        except Exception as e:
            why = f"reference failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
            rows += [(name, label(options), mode, why, None) for mode in modes]
            continue
        for mode in modes:
            rows.append((name, label(options), mode, *cell(name, mode, overrides, ref)))
    return rows


def table(rows, modes, skips: bool) -> str:
    """One line per (family, config): each mode's verdict, with the max abs gradient error when it ran."""
    cells: dict = {}
    for name, cfg, mode, verdict, err in rows:
        cells.setdefault((name, cfg), {})[mode] = verdict if err is None else f"{verdict} {err:.0e}"
    lines = ["| family | config | " + " | ".join(modes) + " |", "|---|---|" + "---|" * len(modes)]
    for (name, cfg), by_mode in cells.items():
        lines.append(f"| {name} | {cfg} | " + " | ".join(by_mode.get(m, "") for m in modes) + " |")
    if skips:
        gap = " |" * len(modes)
        for (name, cfg), why in pf.SKIPPED_VARIANTS.items():
            lines.append(f"| {name} | {cfg} | skipped: {why}{gap[2:]} |")
        for name, why in pf.SKIPPED.items():
            lines.append(f"| {name} | | skipped: {why}{gap[2:]} |")
        lines.append(f"\nNot text causal LMs (not swept): {', '.join(pf.NOT_TEXT)}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(pf.MODELS), help="comma-separated names of pf.MODELS")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: dp, tp, parallelize")
    p.add_argument("--no-variants", action="store_true", help="default configs only")
    p.add_argument("--no-skips", action="store_true", help="leave the families that cannot run out of the table")
    p.add_argument("--keep-zeros", action="store_true",
                   help="keep the models' zero-initialised parameters (default: small random values, see pf.build)")
    args = p.parse_args(argv)
    if not pf.available():
        print("PaddleFormers is not installed (pip install -e .[models])", file=sys.stderr)
        return 2
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES)) + sorted(set(args.models.split(",")) - set(pf.MODELS))
    if unknown:
        p.error(f"unknown mode or model: {', '.join(unknown)}")
    rows = sweep(args.models.split(","), modes, not args.no_variants, not args.keep_zeros)
    print(table(rows, modes, not args.no_skips))
    return 0 if all(r[3] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
