"""Ours vs Paddle on 4 gloo ranks: the same GPT with the same placements, step time side by side.

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench vs-paddle [--rounds 2] [--steps 10] [--warmup 3]
                                                               [--out docs/vs_paddle_bench.md]

Layouts: DP4, TP4 and DP2xTP2 on a ("data", "model") mesh. For each, the implementations that can run it:
ours (``ap.parallelize``), Paddle's dygraph semi-auto parallel (``paddle.distributed.shard_layer`` /
``shard_tensor`` / ``shard_optimizer``, same placements), and for DP4 also ``paddle.DataParallel``. The
single process is the reference for both the step time and the loss of every step. Launches alternate
between implementations in ``--rounds`` rounds so that drifting background load hits them alike; the timed
steps of all rounds are pooled and their median reported. Prints the table and writes it, with the
command, to ``--out``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from tools.bench.common import ROOT, GPT_ARGS, add_int_args, int_argv, launch, md_table, progress, run_one, tool


WORKER = tool("_bench_vs_paddle_worker.py")
LAYOUTS = {"DP4": (4, 1, ("ours", "paddle", "paddle_dp")), "TP4": (1, 4, ("ours", "paddle")),
           "DP2xTP2": (2, 2, ("ours", "paddle"))}
SHORT = {"paddle": "vs semi-auto", "paddle_dp": "vs DataParallel", "limit": "vs limit"}
NAMES = {"single": "single process (plain paddle)", "ours": "ours (ap.parallelize)",
         "paddle": "Paddle semi-auto (shard_layer)", "paddle_dp": "paddle.DataParallel"}


def model_args(args) -> list:
    return ["--model", args.model, *int_argv(args, [n for n, _ in GPT_ARGS] + ["warmup", "steps"])]


def run_single(args) -> dict:
    return run_one(WORKER, ["--impl", "single", *model_args(args)])


def run_ranks(args, impl: str, dp: int, tp: int) -> dict:
    res = launch(WORKER, dp * tp, ["--impl", impl, "--dp", dp, "--tp", tp, *model_args(args)], timeout=900)
    return res[0]                                  # times are already the slowest rank's


def layouts(args) -> dict:
    """{layout: implementations} this run measures (PaddleFormers' Llama: ours only)."""
    out = {}
    for name in args.layouts.split(","):
        if name not in LAYOUTS:
            raise SystemExit(f"unknown layout {name!r}; known: {sorted(LAYOUTS)}")
        out[name] = LAYOUTS[name][2] if args.model == "gpt" else ("ours",)
    return out


def collect(args) -> dict:
    """{(layout, impl): {"times": pooled, "losses": [per launch]}}, with the single process under (None, single)."""
    jobs = [(name, impl) for _ in range(args.rounds) for name, impls in layouts(args).items() for impl in impls]
    out = {(None, "single"): run_single(args)}
    out[(None, "single")]["losses"] = [out[(None, "single")]["losses"]]
    for name, impl in progress(jobs, desc="launches (4 gloo ranks each)", unit="launch"):
        dp, tp, _ = LAYOUTS[name]
        r = run_ranks(args, impl, dp, tp)
        slot = out.setdefault((name, impl), {"times": [], "losses": []})
        slot["times"] += r["times"]
        slot["losses"].append(r["losses"])
    return out


def table(res: dict, chosen: dict) -> tuple:
    """Rows and {layout: {impl or "limit": ours / it}}; limit = single-process step / min(ranks, cores)."""
    single = res[(None, "single")]
    ref, t1 = single["losses"][0], statistics.median(single["times"])
    rows, ratios = [["-", NAMES["single"], f"{t1 * 1e3:.1f}", "1.00", "-", "-", "0"]], {}
    for name, impls in chosen.items():
        dp, tp, _ = LAYOUTS[name]
        limit = t1 / min(dp * tp, os.cpu_count() or 1)
        med = {i: statistics.median(res[(name, i)]["times"]) for i in impls}
        ratios[name] = {i: med["ours"] / med[i] for i in med if i != "ours"}
        ratios[name]["limit"] = med["ours"] / limit
        for impl in impls:
            r = res[(name, impl)]
            err = max(abs(a - b) for run in r["losses"] for a, b in zip(run, ref))
            mine = impl == "ours"
            vs = ", ".join(f"{SHORT[i]} {v:.2f}" for i, v in ratios[name].items() if i != "limit") if mine else "-"
            lim = f"{ratios[name]['limit']:.2f} (limit {limit * 1e3:.0f} ms)" if mine else "-"
            rows.append([name, NAMES[impl], f"{med[impl] * 1e3:.1f}", f"{med[impl] / t1:.2f}", vs or "-", lim,
                         f"{err:.1e}"])
    return rows, ratios


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_int_args(p, GPT_ARGS + (("warmup", 3), ("steps", 10), ("rounds", 2)))
    p.add_argument("--model", choices=("gpt", "pf-llama"), default="gpt")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, from " + ", ".join(LAYOUTS))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "vs_paddle_bench.md"))
    args = p.parse_args()
    load = os.getloadavg()[0]
    start = time.time()
    rows, ratios = table(collect(args), layouts(args))
    what = (f"GPT (`examples/models/gpt.py`): vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
            f"{args.heads} heads" if args.model == "gpt" else
            f"PaddleFormers `LlamaForCausalLM` (`fuse_rms_norm=False`, default plans through `ap.parallelize`): vocab "
            f"{args.vocab}, hidden {args.hidden}, intermediate {4 * args.hidden}, {args.layers} layers, {args.heads} heads")
    text = f"""# Ours vs Paddle: {args.model} training step on 4 gloo ranks

Command (this machine: {os.cpu_count()} cores shared with other work, OMP_NUM_THREADS=1 per rank; 1-minute load
{load:.1f} before the run, {time.time() - start:.0f} s in all):

```
OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench vs-paddle --model {args.model} --layouts {args.layouts} --hidden {args.hidden} --layers {args.layers} --heads {args.heads} --rounds {args.rounds} --steps {args.steps} --warmup {args.warmup}
```

{what},
sequence {args.seq}, global batch {args.batch}; AdamW; float32; same seed and same fixed batch every step. A step is
forward + cross-entropy + backward + `opt.step()` + `opt.clear_grad()` + `float(loss)`; {args.warmup} warm-up and
{args.steps} timed steps per launch, {args.rounds} launches per implementation (alternating), the slowest rank's
time per step, medians over the pooled steps. Placements: Megatron (column-parallel qkv/fc1/lm_head, row-parallel
proj/fc2, vocab-parallel wte) on the "model" dim, batch on the "data" dim, the same for ours and Paddle
semi-auto; `paddle.DataParallel` trains each rank on its quarter of the batch. "ours / limit": ours against the
single-process step time divided by min(ranks, cores) -- what perfect scaling on this machine's cores would give.
The last column compares every step's loss with the single process.

{md_table(rows)}

Ours / Paddle and ours / limit, same layout: {"; ".join(f"{k} " + ", ".join(f"{SHORT[i]} {v:.2f}" for i, v in r.items())
                                    for k, r in ratios.items())}.
"""
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
