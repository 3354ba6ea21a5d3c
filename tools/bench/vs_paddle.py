"""Ours vs Paddle on 4 gloo ranks: the same model with the same placements, step time side by side.

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench vs-paddle [--rounds 2] [--steps 10] [--warmup 3]
                                                               [--model pf-llama --hidden 512]
                                                               [--out docs/vs_paddle_bench.md]

Models: the project's GPT, or PaddleFormers' ``LlamaForCausalLM`` (``--model pf-llama``). Layouts: DP4, TP4
and DP2xTP2 on a ("data", "model") mesh. For each, the implementations that can run it: ours
(``ap.parallelize``), Paddle's dygraph semi-auto parallel (``paddle.distributed.shard_layer`` /
``shard_tensor`` / ``shard_optimizer``, same placements), and for DP4 also ``paddle.DataParallel``. The
single process (one thread, as every rank) is the reference for the step time and the loss of every step;
it also runs with two threads, to show what the machine's two cores give one process. Launches alternate
between implementations (single processes included) in ``--rounds`` rounds so that drifting background
load hits them alike; the timed steps of all rounds are pooled and their median reported.

Besides wall time, every step's CPU time summed over the ranks is reported against the single process's:
with more ranks than cores the cores are the bottleneck, so wall / limit cannot fall below that CPU ratio
however the ranks are scheduled -- it separates work the ranks add from time lost to machine load. Prints
the table and writes it, with the command, to ``--out``.

``--categories``: instead, one launch per implementation and layout (and the single process) whose rank 0
runs a CPU-time cProfile of ``--steps`` more steps; prints rank 0's CPU per step by category (paddle's C++
ops and autograd, the collectives, autoparallel's Python, paddle's Python) side by side -- where our step
spends CPU that Paddle's does not.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from tqdm import tqdm

from autoparallel.testing.launch import child_env, launch
from tools.bench.common import ROOT, tool

WORKER = tool("_bench_vs_paddle_worker.py")
LAYOUTS = {"DP4": (4, 1, ("ours", "paddle", "paddle_dp")), "TP4": (1, 4, ("ours", "paddle")),
           "DP2xTP2": (2, 2, ("ours", "paddle"))}
SHORT = {"paddle": "vs semi-auto", "paddle_dp": "vs DataParallel", "limit": "vs limit"}
NAMES = {"single": "single process (plain paddle, 1 thread)", "single2": "single process, 2 threads",
         "ours": "ours (ap.parallelize)",
         "paddle": "Paddle semi-auto (shard_layer)", "paddle_dp": "paddle.DataParallel"}


def model_args(args) -> list:
    return ["--model", args.model, "--vocab", args.vocab, "--hidden", args.hidden, "--layers", args.layers, "--heads", args.heads,
            "--seq", args.seq, "--batch", args.batch, "--warmup", args.warmup, "--steps", args.steps]


def run_single(args, threads: int = 1, extra=()) -> dict:
    import json
    import tempfile

    d = tempfile.mkdtemp(prefix="ap_bench_vs_paddle_")
    env = child_env({"OMP_NUM_THREADS": str(threads), "AP_RESULT_DIR": d, "GLOG_minloglevel": "2"})
    proc = subprocess.run([sys.executable, WORKER, "--impl", "single", *map(str, model_args(args)), *extra], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    path = os.path.join(d, "rank0.json")
    if proc.returncode or not os.path.exists(path):
        raise RuntimeError(f"single-process run failed ({proc.returncode}):\n{proc.stdout.decode()[-3000:]}")
    with open(path) as f:
        return json.load(f)


def run_ranks(args, impl: str, dp: int, tp: int, extra=()) -> dict:
    res = launch(WORKER, dp * tp, ["--impl", impl, "--dp", dp, "--tp", tp, *model_args(args), *extra], timeout=900)
    return res[0]                                  # times are already the slowest rank's


def layouts(args) -> dict:
    """{layout: implementations} this run measures."""
    out = {}
    for name in args.layouts.split(","):
        if name not in LAYOUTS:
            raise SystemExit(f"unknown layout {name!r}; known: {sorted(LAYOUTS)}")
        out[name] = LAYOUTS[name][2]
    return out


def collect(args) -> dict:
    """{(layout, impl): {"times", "cpu": pooled, "losses": [per launch]}}; single processes under (None, impl)."""
    jobs = [(name, impl) for _ in range(args.rounds)
            for name, impls in [(None, ("single", "single2"))] + list(layouts(args).items()) for impl in impls]
    out = {}
    for name, impl in tqdm(jobs, desc="launches (single processes, 4 gloo ranks)", unit="launch", file=sys.stderr):
        if name is None:
            r = run_single(args, threads=2 if impl == "single2" else 1)
        else:
            dp, tp, _ = LAYOUTS[name]
            r = run_ranks(args, impl, dp, tp)
        slot = out.setdefault((name, impl), {"times": [], "cpu": [], "losses": []})
        slot["times"] += r["times"]
        slot["cpu"] += r["cpu"]
        slot["losses"].append(r["losses"])
    return out


def _row(res, ref, t1, c1, name, impl, vs="-", lim="-", cpu_vs="-") -> list:
    r = res[(name, impl)]
    t, c = statistics.median(r["times"]), statistics.median(r["cpu"])
    err = max(abs(a - b) for run in r["losses"] for a, b in zip(run, ref))
    return [name or "-", NAMES[impl], f"{t * 1e3:.1f}", f"{t / t1:.2f}", vs, lim, f"{c * 1e3:.0f}", f"{c / c1:.2f}",
            cpu_vs, f"{err:.1e}"]


def table(res: dict, chosen: dict) -> tuple:
    """Rows and {layout: {impl or "limit": ours / it, "cpu " + impl: ours' CPU / its}}.

    limit = single-process step / min(ranks, cores); CPU ratios are of the median step CPU time summed over
    the ranks."""
    single = res[(None, "single")]
    ref = single["losses"][0]
    t1, c1 = statistics.median(single["times"]), statistics.median(single["cpu"])
    rows = [_row(res, ref, t1, c1, None, "single"), _row(res, ref, t1, c1, None, "single2")]
    ratios = {}
    for name, impls in chosen.items():
        dp, tp, _ = LAYOUTS[name]
        limit = t1 / min(dp * tp, os.cpu_count() or 1)
        med = {i: statistics.median(res[(name, i)]["times"]) for i in impls}
        cpu = {i: statistics.median(res[(name, i)]["cpu"]) for i in impls}
        ratios[name] = {i: med["ours"] / med[i] for i in med if i != "ours"}
        ratios[name]["limit"] = med["ours"] / limit
        ratios[name].update({"cpu " + i: cpu["ours"] / cpu[i] for i in cpu if i != "ours"})
        ratios[name]["cpu single"] = cpu["ours"] / c1
        for impl in impls:
            mine = impl == "ours"
            vs = ", ".join(f"{SHORT[i]} {ratios[name][i]:.2f}" for i in impls if i != "ours") if mine else "-"
            lim = f"{ratios[name]['limit']:.2f} (limit {limit * 1e3:.0f} ms)" if mine else "-"
            cvs = ", ".join(f"{SHORT[i]} {ratios[name]['cpu ' + i]:.2f}" for i in impls if i != "ours") if mine else "-"
            rows.append(_row(res, ref, t1, c1, name, impl, vs or "-", lim, cvs or "-"))
    return rows, ratios


def categories(args) -> str:
    """Rank 0's CPU ms per step by category, one column per (layout, implementation) and the single process."""
    cols = {"single": run_single(args, extra=["--categories"])["categories"]}
    for name, impls in tqdm(list(layouts(args).items()), desc="layouts", unit="layout", file=sys.stderr):
        dp, tp, _ = LAYOUTS[name]
        for impl in impls:
            cols[f"{name} {impl}"] = run_ranks(args, impl, dp, tp, ["--categories"])["categories"]
    keys = sorted({k for c in cols.values() for k in c}, key=lambda k: -cols["single"].get(k, 0))
    lines = ["| CPU ms per step (rank 0) | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for k in keys + ["total"]:
        vals = [sum(c.values()) if k == "total" else c.get(k, 0.0) for c in cols.values()]
        lines.append(f"| {k} | " + " | ".join(f"{v * 1e3:.1f}" for v in vals) + " |")
    return "\n".join(lines)


def _ratio_text(key: str, v: float) -> str:
    if key.startswith("cpu "):
        return f"CPU {SHORT.get(key[4:], 'vs ' + key[4:])} {v:.2f}"
    return f"{SHORT[key]} {v:.2f}"


def md(rows) -> str:
    header = ["layout", "implementation", "median step ms", "vs single", "ours / Paddle (median step time)",
              "ours / limit", "CPU ms per step, all ranks", "CPU vs single", "ours / Paddle (CPU)",
              "max |loss - single|, every step"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("vocab", 1024), ("hidden", 256), ("layers", 4), ("heads", 8), ("seq", 128),
                          ("batch", 8), ("warmup", 3), ("steps", 10), ("rounds", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--model", choices=("gpt", "pf-llama"), default="gpt")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, from " + ", ".join(LAYOUTS))
    p.add_argument("--out", default=None, help="markdown file to write (default docs/vs_paddle_bench.md)")
    p.add_argument("--categories", action="store_true",
                   help="rank 0's CPU per step by category (prints only: one launch each, no --out, no --rounds)")
    return p


def check_args(p, args) -> None:
    """Refuse what the run would ignore or cannot do, before any launch."""
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        p.error(f"expected --steps >= 1, --warmup >= 0, --rounds >= 1, got {args.steps}, {args.warmup}, {args.rounds}")
    unknown = [n for n in args.layouts.split(",") if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    if args.categories and (args.out is not None or args.rounds != p.get_default("rounds")):
        p.error("--categories prints one launch per implementation: --out and --rounds do not apply to it")


def command(p, args) -> str:
    """The command line of this run, as the doc quotes it (the sizes always; vocab, seq, batch when changed)."""
    extra = "".join(f" --{k} {getattr(args, k)}" for k in ("vocab", "seq", "batch")
                    if getattr(args, k) != p.get_default(k))
    return (f"OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench vs-paddle --model {args.model} "
            f"--layouts {args.layouts} --hidden {args.hidden} --layers {args.layers} --heads {args.heads}{extra} "
            f"--rounds {args.rounds} --steps {args.steps} --warmup {args.warmup}")


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    if args.categories:
        load = os.getloadavg()[0]
        print(f"{args.model}, hidden {args.hidden}, {args.layers} layers; 1-minute load {load:.1f}\n" + categories(args))
        return 0
    args.out = args.out or os.path.join(ROOT, "docs", "vs_paddle_bench.md")
    load = os.getloadavg()[0]
    start = time.time()
    rows, ratios = table(collect(args), layouts(args))
    what = (f"GPT (`examples/models/gpt.py`): vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
            f"{args.heads} heads" if args.model == "gpt" else
            f"PaddleFormers `LlamaForCausalLM` (`fuse_rms_norm=False`; ours: the default plan of `ap.parallelize`, "
            f"Paddle semi-auto: the same Megatron placements by layer name): vocab {args.vocab}, hidden {args.hidden}, "
            f"intermediate {4 * args.hidden}, {args.layers} layers, {args.heads} heads")
    text = f"""# Ours vs Paddle: {args.model} training step on 4 gloo ranks

Command (this machine: {os.cpu_count()} cores shared with other work, OMP_NUM_THREADS=1 per rank; 1-minute load
{load:.1f} before the run and {os.getloadavg()[0]:.1f} after, {time.time() - start:.0f} s in all):

```
{command(p, args)}
```

{what},
sequence {args.seq}, global batch {args.batch}; AdamW; float32; same seed and same fixed batch every step. A step is
forward + cross-entropy + backward + `opt.step()` + `opt.clear_grad()` + `float(loss)`; {args.warmup} warm-up and
{args.steps} timed steps per launch, {args.rounds} launches per implementation (alternating, the single processes
included), the slowest rank's time per step, medians over the pooled steps. Placements: Megatron
(column-parallel q/k/v/qkv, fc1/gate/up and lm_head, row-parallel proj/o and fc2/down, vocab-parallel
embedding) on the "model" dim, batch on the "data" dim, the same for ours and Paddle semi-auto;
`paddle.DataParallel` trains each rank on its quarter of the batch. "ours / limit": ours against the
single-process (one thread) step time divided by min(ranks, cores) -- what perfect scaling on this machine's
cores would give. "CPU": `time.process_time` of each step summed over the ranks; with 4 ranks on {os.cpu_count()} cores
the step cannot take less than that sum / {os.cpu_count()}, so "CPU vs single" bounds "ours / limit" from below
whatever the load. The last column compares every step's loss with the single process.

{md(rows)}

Same layout, ours against: {"; ".join(f"{k} " + ", ".join(_ratio_text(i, v) for i, v in r.items()) for k, r in ratios.items())}.
"""
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
