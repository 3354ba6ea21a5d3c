"""Pipeline schedules on real gloo ranks: step time, measured bubble next to the planned one, timelines.

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench pipeline [--ranks 2,4] [--micro-batches 8] [--steps 3]
                                                              [--warmup 1] [--out docs/pipeline_bench.md]
                                                              [--img docs/img]

For every rank count (pure pipeline: pp = ranks) and schedule (FThenB, 1F1B, VPP with 2 virtual stages,
ZB-H1) it launches this script on that many ranks (``python -m paddle.distributed.launch``, one launch per
rank count), trains a GPT with ``apply_pp`` and AdamW, and records every executed action
``(rank, kind, stage, microbatch, start, end)`` of the last timed step. Reported per schedule:

* step time: the slowest rank's ``train_batch`` + ``opt.step`` time, fastest and median over the timed steps;
* measured bubble: ``bubble_fraction`` of the recorded F/B/W actions of the fastest step (idle share of
  compute slots);
* planned bubble: ``simulate()`` of the same action lists with the measured mean F/B/W time of each stage
  (what the schedule alone explains), and the equal-stage formula;
* p2p: time each rank spends in SEND/RECV actions per step (blocking on gloo: waits included).

The measured and planned timelines are written as PNGs (``docs/img/pipeline_<ranks>r_<schedule>*.png``);
the table and the command go to ``--out``. A single-process row trains the same model on the same
global batch with gradient accumulation over the same micro-batches (no pipeline).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from tools.bench.common import ROOT, launch, tool


SCHEDULES = [("FThenB", 1), ("1F1B", 1), ("VPP", 2), ("ZB-H1", 1)]
MODEL = dict(vocab_size=256, hidden=128, layers=8, heads=4)


def _model(seq: int, seed: int = 0):
    import paddle

    from examples.models import GPT, GPTConfig

    paddle.seed(seed)
    return GPT(GPTConfig(max_positions=seq, **MODEL))


def _batch(batch: int, seq: int, step: int):
    import numpy as np

    rng = np.random.default_rng(step)
    return rng.integers(0, MODEL["vocab_size"], (batch, seq)), rng.integers(0, MODEL["vocab_size"], (batch, seq))


# ---- on every rank ---------------------------------------------------------------------------------------
def worker(cfg: dict) -> None:
    import paddle
    import paddle.distributed as dist

    from autoparallel.parallel.pipeline.runtime import apply_pp
    from autoparallel.strategy import Strategy
    from autoparallel.testing.launch import write_result

    paddle.set_device("cpu")
    dist.init_parallel_env()
    world = dist.get_world_size()
    out = {}
    for name, vpp in SCHEDULES:
        s = Strategy()
        s.pipeline_parallel.degree = world
        s.pipeline_parallel.micro_batches = cfg["micro_batches"]
        s.pipeline_parallel.schedule = name
        s.pipeline_parallel.vpp_degree = vpp
        model = _model(cfg["seq"])
        pipe = apply_pp(model, s)
        opt = pipe.wrap_optimizer(paddle.optimizer.AdamW(1e-4, parameters=model.parameters()))
        times, records, sent = [], [], 0
        for step in range(cfg["warmup"] + cfg["steps"]):
            x, y = _batch(cfg["batch"], cfg["seq"], step)
            dist.barrier()
            before = pipe.transport.p2p.sent_bytes
            t0 = time.perf_counter()
            pipe.train_batch(x, y)
            opt.step()
            opt.clear_grad()
            if step >= cfg["warmup"]:
                times.append(time.perf_counter() - t0)
                records.append([list(r) for r in pipe.records])
            sent = pipe.transport.p2p.sent_bytes - before
        out[name] = {"times": times, "records": records, "bounds": pipe.plan.bounds, "sent_bytes": sent}
    write_result(out)


# ---- the launcher ------------------------------------------------------------------------------------------
def single_process(cfg: dict) -> tuple:
    """(fastest, median) step time of the unsplit model on one process: the same micro-batches, accumulated."""
    import paddle
    import paddle.nn.functional as F

    model = _model(cfg["seq"])
    opt = paddle.optimizer.AdamW(1e-4, parameters=model.parameters())
    m, times = cfg["micro_batches"], []
    for step in range(cfg["warmup"] + cfg["steps"]):
        x, y = _batch(cfg["batch"], cfg["seq"], step)
        t0 = time.perf_counter()
        for xs, ys in zip(paddle.split(paddle.to_tensor(x), m), paddle.split(paddle.to_tensor(y), m)):
            (F.cross_entropy(model(xs), ys) / m).backward()
        opt.step()
        opt.clear_grad()
        if step >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def stage_means(records, num_stages: int) -> dict:
    """Mean duration of each compute kind per stage (None where a kind never ran)."""
    out = {}
    for kind in ("F", "B", "W"):
        per = [[e - s for _, k, st, _, s, e in records if k == kind and st == stage] for stage in range(num_stages)]
        out[kind] = [statistics.mean(v) for v in per] if all(per) else None
    return out


def analyse(nproc: int, name: str, vpp: int, ranks: list, cfg: dict, img_dir: str) -> dict:
    from autoparallel.parallel.pipeline import bubble_formula, bubble_fraction, make_schedule, simulate
    from autoparallel.parallel.pipeline.timeline import plot_timeline

    m = cfg["micro_batches"]
    runs = [r[name] for r in ranks]
    steps = [max(ts) for ts in zip(*(run["times"] for run in runs))]          # slowest rank per step
    best = min(range(len(steps)), key=steps.__getitem__)
    records = [tuple(x) for run in runs for x in run["records"][best]]
    sched = make_schedule(name, nproc, m, vpp)
    means = stage_means(records, sched.num_stages)
    sim = simulate(sched, forward=means["F"], backward=means["B"], weight=means["W"])
    measured = bubble_fraction(records, nproc)
    slug = f"pipeline_{nproc}r_{name.lower().replace('-', '')}"
    title = f"{name} pp={nproc} m={m}" + (f" vpp={vpp}" if vpp > 1 else "")
    plot_timeline(records, os.path.join(img_dir, slug + ".png"), title=f"measured: {title}", num_ranks=nproc,
                  time_unit="s")
    plot_timeline(sim.records(), os.path.join(img_dir, slug + "_planned.png"),
                  title=f"planned (measured stage times): {title}", num_ranks=nproc, time_unit="s")
    comm = [sum(e - s for rk, k, *_, s, e in records if rk == r and k.startswith(("SEND", "RECV")))
            for r in range(nproc)]
    return {"ranks": nproc, "schedule": name, "m": m, "vpp": vpp, "step": steps[best],
            "median": statistics.median(steps), "measured": measured,
            "planned": sim.bubble_fraction, "formula": bubble_formula(name, nproc, m, vpp),
            "planned_span": sim.total_time, "measured_span": _span(records),
            "f": statistics.mean(means["F"]), "b": statistics.mean(means["B"]),
            "w": statistics.mean(means["W"]) if means["W"] else None, "p2p": statistics.mean(comm),
            "sent": max(run["sent_bytes"] for run in runs), "img": slug, "bounds": runs[0]["bounds"]}


def _span(records) -> float:
    comp = [r for r in records if r[1] in ("F", "B", "W")]
    return max(r[5] for r in comp) - min(r[4] for r in comp)


def table(rows: list, single: tuple, cfg: dict) -> str:
    head = ("| ranks | schedule | step ms (fastest / median) | speed-up vs 1 process (fastest) | measured bubble | "
            "planned bubble (simulated, measured stage times) | formula (equal stages) | compute span ms "
            "(measured / planned) | mean F / B / W ms per stage | p2p ms per rank-step | sent per rank-step |\n"
            + "|---" * 11 + "|\n")
    lines = [f"| 1 | no pipeline (accumulate {cfg['micro_batches']} micro-batches) | {single[0] * 1e3:.0f} / "
             f"{single[1] * 1e3:.0f} | 1.00 | - | - | - | - | - | - | - |"]
    for r in rows:
        w = f" / {r['w'] * 1e3:.1f}" if r["w"] is not None else ""
        lines.append(f"| {r['ranks']} | {r['schedule']}{' v=' + str(r['vpp']) if r['vpp'] > 1 else ''} | "
                     f"{r['step'] * 1e3:.0f} / {r['median'] * 1e3:.0f} | {single[0] / r['step']:.2f} | "
                     f"{r['measured']:.3f} | {r['planned']:.3f} | {r['formula']:.3f} | "
                     f"{r['measured_span'] * 1e3:.0f} / {r['planned_span'] * 1e3:.0f} | "
                     f"{r['f'] * 1e3:.1f} / {r['b'] * 1e3:.1f}{w} | {r['p2p'] * 1e3:.1f} | "
                     f"{r['sent'] / 2**20:.2f} MiB |")
    return head + "\n".join(lines) + "\n"


def schedule_problem(ranks, micro_batches) -> str:
    """Why some schedule cannot run on some rank count ('' when all can), before any launch."""
    from autoparallel.parallel.pipeline import make_schedule

    for nproc in ranks:
        for name, vpp in SCHEDULES:
            if nproc * vpp > MODEL["layers"]:
                return (f"--ranks {nproc}: {name} needs {nproc * vpp} stages, the benchmark model has "
                        f"{MODEL['layers']} blocks")
            try:
                make_schedule(name, nproc, micro_batches, vpp)
            except ValueError as e:
                return f"--ranks {nproc} --micro-batches {micro_batches}: {e}"
    return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4", help="comma-separated rank counts (pipeline degree = ranks)")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per schedule")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "pipeline_bench.md"))
    ap.add_argument("--img", default=os.path.join(ROOT, "docs", "img"))
    args = ap.parse_args(argv)
    try:
        ranks = [int(x) for x in args.ranks.split(",")]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 2 or args.micro_batches < 1 or args.micro_batch_size < 1 or args.steps < 1 \
            or args.warmup < 0:
        ap.error(f"expected --ranks as comma-separated counts >= 2, --micro-batches, --micro-batch-size and --steps "
                 f">= 1 and --warmup >= 0, got {args.ranks!r}, {args.micro_batches}, {args.micro_batch_size}, "
                 f"{args.steps}, {args.warmup}")
    problem = schedule_problem(ranks, args.micro_batches)
    if problem:
        ap.error(problem)
    cfg = {"micro_batches": args.micro_batches, "batch": args.micro_batches * args.micro_batch_size,
           "seq": args.seq, "steps": args.steps, "warmup": args.warmup}
    os.makedirs(args.img, exist_ok=True)
    single = single_process(cfg)
    print(f"single process: {single[0] * 1e3:.0f} ms per step (fastest), {single[1] * 1e3:.0f} ms (median)")
    rows = []
    for nproc in ranks:
        t0 = time.perf_counter()
        ranks = launch(tool("_bench_pipeline_worker.py"), nproc, [json.dumps(cfg)], timeout=1200)
        print(f"{nproc} ranks: launch took {time.perf_counter() - t0:.0f} s")
        for name, vpp in SCHEDULES:
            row = analyse(nproc, name, vpp, ranks, cfg, args.img)
            rows.append(row)
            print(f"  {row['schedule']:7s} step {row['step'] * 1e3:7.0f} ms (median {row['median'] * 1e3:.0f})  "
                  f"bubble measured {row['measured']:.3f} planned {row['planned']:.3f} formula {row['formula']:.3f}  "
                  f"p2p {row['p2p'] * 1e3:.0f} ms")
    md = render(rows, single, cfg, args)
    with open(args.out, "w") as f:
        f.write(md)
    print(table(rows, single, cfg))
    print(f"wrote {args.out} and {len(rows) * 2} PNGs under {args.img}")
    return 0


def render(rows, single, cfg, args) -> str:
    import paddle

    cmd = (f"OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench pipeline --ranks {args.ranks} "
           f"--micro-batches {args.micro_batches} --micro-batch-size {args.micro_batch_size} --seq {args.seq} "
           f"--steps {args.steps} --warmup {args.warmup}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    splits = "; ".join(f"{r['ranks']} ranks {r['schedule']}: {r['bounds']}" for r in rows
                       if r["schedule"] in ("1F1B", "VPP"))
    rel = os.path.relpath(os.path.abspath(args.img), os.path.dirname(os.path.abspath(args.out)))   # links from --out
    imgs = "\n".join(f"![{r['schedule']} on {r['ranks']} ranks, measured]({rel}/{r['img']}.png)\n"
                     f"![{r['schedule']} on {r['ranks']} ranks, planned]({rel}/{r['img']}_planned.png)\n" for r in rows)
    return f"""# Pipeline benchmark: schedules on real gloo ranks

Generated by `python -m tools.bench pipeline` on this machine ({platform.machine()}, {os.cpu_count()} cores,
Python {platform.python_version()}, paddle {paddle.__version__}, OMP_NUM_THREADS=1 per rank; 1-minute load
average {load:.1f} when the report was written). Command:

```
{cmd}
```

What runs: `apply_pp(model, strategy)` (`autoparallel/parallel/pipeline/runtime.py`) splits the model into
stage modules (`stage.py`), creates one 2-rank gloo group per pair of neighbouring ranks (`p2p.py`) and
returns a `PipelineModule`; `train_batch(ids, labels)` executes this rank's action list from
`make_schedule` (forward, send, receive, backward, and for ZB-H1 the deferred Linear weight gradients of
`zero_bubble.py`), recording every action; `wrap_optimizer` gives the AdamW over the rank's own stages.

Model: GPT (vocab {MODEL['vocab_size']}, hidden {MODEL['hidden']}, {MODEL['layers']} blocks, {MODEL['heads']} heads),
sequence {cfg['seq']}, global batch {cfg['batch']} = {cfg['micro_batches']} micro-batches of
{cfg['batch'] // cfg['micro_batches']}; AdamW. Pure pipeline: pp = ranks (VPP: 2 virtual stages per rank).
Stages are balanced by traced forward FLOPs, embedding and head included ({splits}).
Each schedule: {cfg['warmup']} warm-up step(s), then {cfg['steps']} timed steps, each after a barrier.

Columns: **step ms** is the slowest rank's `train_batch` + `opt.step` time, for the fastest timed step and
the median over timed steps (this machine is shared, so the fastest step is the least disturbed one).
The other columns describe that fastest step: **measured bubble** is `bubble_fraction` of the F/B/W actions
recorded on every rank (idle share of compute slots, from the first compute start to the last compute end).
**planned bubble** is `simulate()` of the same action lists with the measured mean F/B/W time of each
stage and zero latency: the bubble the schedule itself implies for these stage times. **formula** is the
textbook equal-stage value ((p-1)/(m+p-1); VPP (p-1)/(v·m+p-1); ZB-H1 with F = B = W (p-1)/(3m+p-1)).
**p2p ms** is the time a rank spends inside SEND/RECV actions per step: gloo's send and receive block until
the other end arrives, so this includes waiting for the peer, not only transfer time.

{table(rows, single, cfg)}
Reading the numbers: the difference between measured and planned bubble is what the schedule does not
explain: p2p latency (each gloo send/receive is a blocking rendezvous costing a few hundred microseconds
here, and VPP sends (p·v-1)/(p-1) times as many), Python overhead between actions, and ranks competing for
the CPU: with 4 ranks on {os.cpu_count()} cores (and, while this report was made, other jobs on the same
machine: see the load average above) a rank is often descheduled while its peer waits, which inflates
both the F/B times and the idle time. Repeated runs on a shared machine differ by tens of percent; treat
the speed-ups as indicative and the timelines as the evidence of what each schedule executes. ZB-H1's
weight-gradient actions fill the drain phase, as planned; its B and W are timed separately, so its F/B/W
means are not comparable one to one with the other schedules' B.

## Timelines (measured, then planned from the measured stage times)

{imgs}"""


if __name__ == "__main__":
    sys.exit(main())
