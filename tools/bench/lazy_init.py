"""Lazy, sharded initialisation vs eager initialisation on 4 gloo ranks (TP2 x DP2 + ZeRO-3, AdamW).

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench lazy-init [--model gpt-100m]

Per mode one launch; per rank: build time, parallelize time (lazy: the materialisation happens there),
peak resident set, live parameter bytes after parallelize (ZeRO-3 master chunks), and, for lazy init, the
largest tensor allocated for any parameter. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import statistics

from tools.bench.common import launch, tool


MB = 2 ** 20


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-100m", help="a preset of examples/models")
    return ap


def main(argv=None) -> int:
    from examples.models import PRESETS

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model not in PRESETS:
        parser.error(f"unknown --model {args.model!r}; presets: {', '.join(sorted(PRESETS))}")
    worker = tool("_bench_lazy_init_worker.py")
    rows = []
    for mode in ("eager", "lazy"):
        ranks = launch(worker, 4, [mode, args.model], timeout=1800)
        mean = lambda k: statistics.mean(r[k] for r in ranks)          # noqa: E731
        rows.append((mode, mean("build_s"), mean("parallelize_s"), max(r["peak_rss"] for r in ranks) / MB,
                     max(r["peak_rss"] - r["rss_before"] for r in ranks) / MB,
                     max(r["param_bytes"] for r in ranks) / MB, ranks[0]["largest_tensor_elements"],
                     ranks[0]["full_copies"]))
    print(f"model {args.model}, 4 ranks, TP2 x DP2 + ZeRO-3\n")
    print("| init | build s | parallelize s | peak RSS MiB (max rank) | peak RSS growth MiB | param bytes MiB/rank "
          "| largest tensor (elements) | whole copies |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, b, p, peak, growth, pb, largest, full in rows:
        print(f"| {mode} | {b:.2f} | {p:.2f} | {peak:.0f} | {growth:.0f} | {pb:.1f} | "
              f"{'-' if largest is None else largest} | {'-' if full is None else full} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
