"""Memory per rank on 4 gloo ranks, from the training example's JSON logs: ZeRO stages and recompute.

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench memory [--model gpt-100m-byte] [--steps 3]
                                                             [--out docs/memory_bench.md]

1. ZeRO: the GPT example (``--model``, ~100M parameters by default) under DP4 and ZeRO stage 1, 2, 3 over
   the same 4 ranks. Per rank: parameter, gradient and optimizer-state bytes counted from live tensors, and
   the RSS change (resident set now minus before the model was built), which cross-checks the count:
   the RSS saved by a stage should be about the state bytes it saves.
2. Recompute: none / full / selective under DP4: saved-activation bytes of a forward (counted by
   ``autoparallel.parallel.recompute.SavedBytes``) and the median step time.

Writes the tables, the command and a PNG of the per-rank memory breakdown (docs/img/memory_zero.png).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from tools.bench.common import ROOT, md_table, progress


ZERO = {"DP4": [], "ZeRO-1": ["--sharding-stage", "1"], "ZeRO-2": ["--sharding-stage", "2"],
        "ZeRO-3": ["--sharding-stage", "3"]}
RECOMPUTE = {"none": [], "full": ["--recompute", "full"], "selective": ["--recompute", "selective"]}
STATE = ("params", "grads", "optimizer_states")
MB = 2 ** 20


def run_example(args, extra: list) -> dict:
    """One launch of examples/train_gpt.py on 4 ranks (through ``autoparallel demo``); its JSON log."""
    log = os.path.join(tempfile.mkdtemp(prefix="ap_bench_memory_"), "log.json")
    argv = ["--dp", "4", "--model", args.model, "--steps", str(args.steps), "--batch-size", str(args.batch),
            "--seq-len", str(args.seq), "--seed", "0", "--log-json", log, *extra]
    cmd = [sys.executable, "-m", "autoparallel", "demo", "--nproc", "4", "--script",
           os.path.join(ROOT, "examples", "train_gpt.py"), "--", *argv]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode or not os.path.exists(log):
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    with open(log) as f:
        return json.load(f)


def state_bytes(rank: dict) -> int:
    return sum(rank[k] for k in STATE)


def zero_rows(logs: dict) -> list:
    dp = logs["DP4"]["memory_per_rank"]
    dp_state = statistics.mean(state_bytes(r) for r in dp)
    dp_rss = statistics.mean(r["rss"] - r["rss_start"] for r in dp)
    rows = []
    for name, log in logs.items():
        ranks = log["memory_per_rank"]
        state = statistics.mean(state_bytes(r) for r in ranks)
        rss = statistics.mean(r["rss"] - r["rss_start"] for r in ranks)
        rows.append([name] + [f"{statistics.mean(r[k] for r in ranks) / MB:.1f}" for k in STATE] +
                    [f"{state / MB:.1f}", f"{state / dp_state:.3f}", f"{rss / MB:.0f}",
                     f"{(dp_state - state) / MB:.0f}", f"{(dp_rss - rss) / MB:.0f}",
                     f"{max(r['peak_rss'] for r in ranks) / MB:.0f}"])
    return rows


def recompute_rows(logs: dict) -> list:
    base = logs["none"]
    b_act = statistics.mean(r["saved_activations"] for r in base["memory_per_rank"])
    b_time = statistics.median(s["time"] for s in base["steps"][1:])
    rows = []
    for name, log in logs.items():
        act = statistics.mean(r["saved_activations"] for r in log["memory_per_rank"])
        t = statistics.median(s["time"] for s in log["steps"][1:])
        rows.append([name, f"{act / MB:.1f}", f"{act / b_act:.2f}", f"{t * 1e3:.0f}", f"{t / b_time:.2f}",
                     f"{log['steps'][-1]['loss']:.6f}"])
    return rows


def plot(logs: dict, path: str, model: str = "gpt-100m-byte") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(logs)
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(names)
    for key in STATE:
        vals = [statistics.mean(r[key] for r in logs[n]["memory_per_rank"]) / MB for n in names]
        ax.bar(names, vals, bottom=bottom, label=key.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    rss = [statistics.mean(r["rss"] - r["rss_start"] for r in logs[n]["memory_per_rank"]) / MB for n in names]
    ax.plot(names, rss, "ko--", label="RSS change")
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"Model state per rank on 4 ranks ({model}, AdamW, fp32)")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-100m-byte", help="a preset of examples/models")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per launch (>= 2: the first is not timed)")
    p.add_argument("--batch", type=int, default=4, help="global batch (a multiple of 4: DP4)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "memory_bench.md"))
    lora = p.add_argument_group("--lora: a LoRA-shaped model in one simulated 4-rank world (tools/bench/memory_lora.py)")
    lora.add_argument("--lora", action="store_true", help="per-rank bytes of frozen base + adapters, DP and ZeRO 1-3")
    lora.add_argument("--hidden", type=int, default=512)
    lora.add_argument("--layers", type=int, default=4)
    lora.add_argument("--rank", type=int, default=8, help="the adapters' rank r")
    lora.add_argument("--json", default=None, help="also write the --lora figures to this JSON file")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.lora:
        if min(args.hidden, args.layers, args.rank) < 1:
            p.error(f"expected positive --hidden, --layers and --rank, got {args.hidden}, {args.layers}, {args.rank}")
        from tools.bench.memory_lora import main as lora_main

        return lora_main(args)
    from examples.models import PRESETS

    if args.model not in PRESETS:
        p.error(f"unknown --model {args.model!r}; presets: {', '.join(sorted(PRESETS))}")
    if args.steps < 2 or args.batch < 4 or args.batch % 4 or args.seq < 1:
        p.error(f"expected --steps >= 2 (step times skip the first), --batch a positive multiple of 4 and --seq >= 1, "
                f"got {args.steps}, {args.batch}, {args.seq}")
    start, load = time.time(), os.getloadavg()[0]
    jobs = [("zero", n, a) for n, a in ZERO.items()] + [("recompute", n, a) for n, a in RECOMPUTE.items()]
    logs = {"zero": {}, "recompute": {}}
    for kind, name, extra in progress(jobs, desc="launches (4 gloo ranks each)", unit="launch"):
        logs[kind][name] = logs["zero"]["DP4"] if kind == "recompute" and name == "none" else run_example(args, extra)
    png = os.path.join(os.path.dirname(os.path.abspath(args.out)), "img", "memory_zero.png")
    plot(logs["zero"], png, args.model)
    n_params = logs["zero"]["DP4"]["memory_per_rank"][0]["params"] // 4
    text = f"""# Memory per rank: ZeRO stages and recompute (4 gloo ranks)

Command ({os.cpu_count()} cores, OMP_NUM_THREADS=1 per rank, 1-minute load {load:.1f} before, {time.time() - start:.0f} s):

```
OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench memory --model {args.model} --steps {args.steps} --batch {args.batch} --seq {args.seq}
```

`examples/train_gpt.py --model {args.model}` ({n_params / 1e6:.1f}M parameters, AdamW, float32), {args.steps} steps,
global batch {args.batch} x {args.seq} tokens, on 4 ranks, each run launched on its own. Figures are means over the
ranks from the example's JSON log (`memory_per_rank`), taken after the last optimizer step, before
`clear_grad`. **State** = parameters + gradients + optimizer states, counted from live local tensors (ZeRO-3:
the parameter shards; gathered weights are freed after use, which `tests/test_zero_dist.py` checks). **RSS
change** = resident set after the last step minus before the model was built; **saved vs DP4** compares the
state bytes a stage saves with the RSS it saves.

## ZeRO on DP4

{md_table(["run", "params MiB", "grads MiB", "optimizer MiB", "state MiB", "state vs DP4", "RSS change MiB",
     "state saved vs DP4 MiB", "RSS saved vs DP4 MiB", "peak RSS MiB (max rank)"], zero_rows(logs["zero"]))}

![memory per rank](img/memory_zero.png)

## Recompute on DP4

Saved activations: bytes the forward keeps for backward (largest micro-batch of the last step, per rank);
step time: median over the steps after the first.

{md_table(["recompute", "saved activations MiB", "vs none", "median step ms", "time vs none", "final loss"],
    recompute_rows(logs["recompute"]))}
"""
    print(text)
    with open(args.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
