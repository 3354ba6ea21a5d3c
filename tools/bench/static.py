"""Step time of the article's training step on the example GPT: eager (autoparallel dispatch) vs
``@paddle.jit.to_static`` (lowered to one paddle static program per rank), across model sizes.

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench static [--layouts 1,dp2,tp2] [--steps 10] [--warmup 3]
                                                             [--sizes tiny,small,medium] [--out docs/static_bench.md]

Each layout runs tools/_bench_static_worker.py: "1" in this process (a mesh of one rank: dispatch cost, no
communication), "dp2" / "tp2" on 2 gloo ranks. Per size: the median step time (forward, backward,
optimizer step) of each mode after the warm-up steps (slowest rank), the first call (eager: plans
computed; static: the program built), the speed-up, and whether both modes' losses agree (same
initialisation and data). Prints a table and writes it with the command to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from tools.bench.common import ROOT, launch, progress, tool


WORKER = tool("_bench_static_worker.py")
SIZES = {
    "tiny": dict(vocab=256, hidden=32, layers=2, heads=4, seq=16, batch=8),
    "small": dict(vocab=1024, hidden=128, layers=4, heads=4, seq=64, batch=8),
    "medium": dict(vocab=4096, hidden=384, layers=6, heads=6, seq=128, batch=8),
}
LAYOUTS = {"1": dict(world=1, dp=1, tp=1), "dp2": dict(world=2, dp=2, tp=1), "tp2": dict(world=2, dp=1, tp=2)}


def run_layout(name, sizes, steps, warmup) -> list:
    cfg = dict(LAYOUTS[name], sizes=[dict(SIZES[s], name=s) for s in sizes], steps=steps, warmup=warmup)
    if cfg["world"] == 1:
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, AP_RESULT_DIR=d, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
            proc = subprocess.run([sys.executable, WORKER, json.dumps(cfg)], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            if proc.returncode:
                raise RuntimeError(f"the one-process run failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
            with open(os.path.join(d, "rank0.json")) as f:
                ranks = [json.load(f)]
    else:
        ranks = launch(WORKER, cfg["world"], [json.dumps(cfg)], timeout=1800)
    rows = []
    for k, s in enumerate(sizes):
        per = [r["sizes"][k] for r in ranks]
        eager = max(p["eager"]["median"] for p in per)
        static = max(p["static"]["median"] for p in per)
        agree = all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for p in per
                    for a, b in zip(p["eager"]["losses"], p["static"]["losses"]))
        rows.append({"layout": name, "size": s, "eager_ms": 1e3 * eager, "static_ms": 1e3 * static,
                     "speedup": eager / static, "first_eager_ms": 1e3 * max(p["eager"]["first"] for p in per),
                     "first_static_ms": 1e3 * max(p["static"]["first"] for p in per), "losses_agree": agree,
                     "lowered": all(p["static"]["why"] is None for p in per),
                     "why": next((p["static"]["why"] for p in per if p["static"]["why"]), None)})
    return rows


def table(rows) -> str:
    head = ("| layout | model | eager step (ms) | static step (ms) | speed-up | first call eager / static (ms) | "
            "lowered | losses agree |\n|---|---|---:|---:|---:|---:|---|---|\n")
    body = "".join(f"| {r['layout']} | {r['size']} ({_describe(r['size'])}) | {r['eager_ms']:.1f} | "
                   f"{r['static_ms']:.1f} | {r['speedup']:.2f}x | {r['first_eager_ms']:.0f} / "
                   f"{r['first_static_ms']:.0f} | {'yes' if r['lowered'] else 'no: ' + str(r['why'])} | "
                   f"{'yes' if r['losses_agree'] else 'NO'} |\n" for r in rows)
    return head + body


def _describe(name) -> str:
    s = SIZES[name]
    return f"h{s['hidden']} L{s['layers']} T{s['seq']} B{s['batch']} V{s['vocab']}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default="1,dp2,tp2")
    p.add_argument("--sizes", default="tiny,small,medium")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    layouts = [x for x in a.layouts.split(",") if x]
    sizes = [x for x in a.sizes.split(",") if x]
    bad = [x for x in layouts if x not in LAYOUTS] + [x for x in sizes if x not in SIZES]
    if bad:
        p.error(f"unknown layout/size {bad}; layouts {sorted(LAYOUTS)}, sizes {sorted(SIZES)}")
    if a.steps < 1 or a.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    if a.out and not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
        p.error(f"--out: directory of {a.out} does not exist")
    rows = []
    for name in progress(layouts, desc="layouts"):
        rows += run_layout(name, sizes, a.steps, a.warmup)
    text = table(rows)
    print(text)
    if a.out:
        cmd = "OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench static " + " ".join(argv or sys.argv[1:])
        with open(a.out, "w") as f:
            cpu = platform.processor() or platform.machine()
            f.write(f"# eager vs paddle.jit.to_static step time\n\n`{cmd}`\n\n{cpu}, {os.cpu_count()} CPUs, "
                    f"paddle CPU + gloo\n\n{text}")


if __name__ == "__main__":
    main()
