"""Every PaddleFormers causal LM this project runs, in every mode, against one process: a markdown table.

    python tools/check_paddleformers.py [--models llama,qwen2]

Modes on a 2x2 ["data", "model"] mesh in the simulated world (every rank in this process): ``dp`` (batch
split, weights replicated), ``seed`` (the seed article's shard function through ``ap.shard_layer``),
``parallelize`` (``ap.parallelize`` with dp=2, tp=2 and the default plans). Figures: |loss - ref| / |ref| and
the largest over parameters of max|grad - ref| / max|ref| (one forward/backward, tiny configs).
"""
from __future__ import annotations

import argparse


def main(argv=None):
    from tqdm import tqdm

    import autoparallel as ap
    from autoparallel.testing import paddleformers_runs as pc
    from autoparallel.testing import paddleformers_models as pf

    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--models", default=",".join(pf.MODELS), help="comma-separated, from " + ", ".join(pf.MODELS))
    args = ap_.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in pf.MODELS]
    if unknown:
        ap_.error(f"unknown models {unknown}; known: {list(pf.MODELS)}")
    modes = ("dp", "seed", "parallelize")
    rows = []
    for name in tqdm(names, desc="models"):
        ref = pf.reference(name)
        cells = []
        for mode in modes:
            with ap.simulate(world_size=4):
                got = pc.parallelize_grads(name) if mode == "parallelize" else \
                    pf.sharded(name, "tp" if mode == "seed" else "dp")
            cells.append((abs(got[0] - ref[0]) / abs(ref[0]), pc.worst_rel(ref[1], got[1])))
        rows.append((name, cells))
    print("| model | " + " | ".join(f"{m}: loss / grad rel diff" for m in modes) + " |")
    print("|---|" + "---|" * len(modes))
    for name, cells in rows:
        print(f"| {name} | " + " | ".join(f"{l:.1e} / {g:.1e}" for l, g in cells) + " |")


if __name__ == "__main__":
    main()
