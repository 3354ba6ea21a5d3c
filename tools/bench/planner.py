"""Planner speed, calibration and validation benchmark; prints tables and writes docs/planner.md.

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench planner [--out docs/planner.md] [--repeat 5]

Measures: planning LLaMA-2 70B on 1024 A100-80GB (128 nodes of 8), global batch 1536, seq 4096, full
search (every knob: dp, tp, pp, vpp, pipeline split, sp, ZeRO, recompute, micro-batch, offload, and expert
parallelism for MoE models), in-process (median of --repeat) and as the CLI command (one process, imports
included); the MoE models (Mixtral 8x7B, DeepSeek-V3) on H100 clusters; how the time grows with cluster
size and with model depth; the Megatron-LM calibration table; and the validation against published runs
(planner/published.py) with its ratio-vs-GPU-count plot (docs/img/planner_validation.png).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time


from autoparallel.planner import megatron
from autoparallel.planner import published
from tools.bench import planner_doc
from autoparallel.planner.api import plan
from autoparallel.planner.options import PlannerOptions
from tools.bench.common import ROOT, md_table

CLI = ["autoparallel", "plan", "--model", "llama2-70b", "--cluster", "128x8:A100-80GB", "--global-batch", "1536",
       "--seq-len", "4096"]


def timed_plan(repeat, *args, **kwargs):
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = plan(*args, **kwargs)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def cli_seconds():
    exe = os.path.join(os.path.dirname(sys.executable), "autoparallel")
    cmd = [exe] + CLI[1:] if os.path.exists(exe) else [sys.executable, "-m", "autoparallel"] + CLI[1:]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
    return seconds, proc.stdout


def describe_best(result):
    return describe(result.best)


def describe(c):
    return (f"{c.config.short()}: {c.step_time_s:.2f} s/step, {c.tflops_per_device:.0f} "
            f"TFLOP/s/GPU, MFU {100 * c.mfu:.0f}%, {c.memory_per_device_gb:.1f} GB")


MOE_CASES = (("mixtral-8x7b", "128x8:H100-80GB", 1536, 4096), ("deepseek-v3", "256x8:H100-80GB", 4096, 4096),
             ("deepseek-v3", "256x8:H100-80GB", 15360, 4096))     # DeepSeek-V3's own batch: many micro-batch sizes


def valid_count(model, cluster, batch, seq):
    """Every valid configuration of the full space (priced or ruled out by the memory floor)."""
    from autoparallel.planner.cluster import parse_cluster
    from autoparallel.planner.model_spec import PRESETS
    from autoparallel.planner.search import SearchSpace, build_grid

    return len(build_grid(PRESETS[model], parse_cluster(cluster).world_size, batch, seq, SearchSpace(),
                          PlannerOptions())["dp"])


def unpruned_seconds(model, cluster, batch, seq):
    """One search pricing every valid configuration (no memory-floor pruning), for comparison."""
    from autoparallel.planner.cluster import parse_cluster
    from autoparallel.planner.model_spec import PRESETS
    from autoparallel.planner.search import SearchSpace, search

    return search(PRESETS[model], parse_cluster(cluster), batch, seq, SearchSpace(), PlannerOptions(),
                  prune=False).seconds


def moe_rows(repeat):
    rows = []
    for model, cluster, batch, seq in MOE_CASES:
        seconds, result = timed_plan(max(1, repeat // 2), model, cluster, global_batch_size=batch, seq_len=seq)
        full_s = unpruned_seconds(model, cluster, batch, seq)
        rows.append((model, cluster, batch, valid_count(model, cluster, batch, seq), result.evaluated,
                     f"{seconds:.2f}", f"{full_s:.2f}", describe_best(result) if result.feasible else "infeasible"))
        print(f"  {model} on {cluster}: {result.evaluated} configurations priced, {seconds:.2f} s "
              f"(every configuration priced: {full_s:.2f} s)")
    return rows


def validation_section(out_dir):
    rows = published.validation_table(published.RUNS)
    moe = published.validation_table(published.MOE_RUNS)
    search_rows = []
    for run in published.RUNS + published.MOE_RUNS:
        pub = published.predict(run)
        best = published.search_best(run, feasible_only=pub.feasible)
        search_rows.append((run.name, f"{pub.step_time_s:.2f}", "yes" if pub.feasible else "NO",
                            f"{best.step_time_s:.2f}", best.config.short(),
                            f"{pub.step_time_s / best.step_time_s:.2f}x"))
    print(published.format_table(rows + moe))
    png = planner_doc.plot_validation(rows, moe, os.path.join(out_dir, "img", "planner_validation.png"))
    return rows, moe, search_rows, png


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "planner.md"), help="markdown file to write")
    p.add_argument("--repeat", type=int, default=5, help="runs per in-process timing (median)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat must be >= 1 (timings are medians of that many runs), got {args.repeat}")

    # 1. the headline figure
    plan("llama2-70b", "128x8:A100-80GB", global_batch_size=1536, seq_len=4096)          # warm imports
    headline_s, headline = timed_plan(args.repeat, "llama2-70b", "128x8:A100-80GB", global_batch_size=1536,
                                      seq_len=4096)
    dual_s, dual = timed_plan(args.repeat, "llama2-70b", "128x8:A100-80GB", global_batch_size=1536, seq_len=4096,
                              dualpipe=[0, 1])
    cli_s, cli_out = cli_seconds()
    headline_valid = valid_count("llama2-70b", "128x8:A100-80GB", 1536, 4096)
    print(f"llama2-70b on 1024 A100-80GB: {headline.evaluated} configurations, plan() {headline_s:.3f} s "
          f"(median of {args.repeat}), CLI {cli_s:.2f} s wall (with interpreter start and imports)")
    print("  best: " + describe_best(headline))

    # 2. cluster size
    size_rows = []
    for nodes in (1, 4, 16, 64, 128, 256, 512, 1024, 2048):
        seconds, result = timed_plan(args.repeat, "llama2-70b", f"{nodes}x8:A100-80GB", global_batch_size=4096,
                                     seq_len=4096)
        size_rows.append((nodes * 8, result.evaluated, f"{seconds:.3f}",
                          describe_best(result) if result.feasible else "infeasible"))
        print(f"  {nodes * 8:>6} GPUs: {result.evaluated:>7} configurations, {seconds:.3f} s")

    # 3. model depth (hidden 8192, 64 heads, GPT-style), 1024 GPUs
    depth_rows = []
    for layers in (24, 48, 96, 192, 384):
        model = f"hidden=8192,layers={layers},heads=64,vocab=51200"
        seconds, result = timed_plan(args.repeat, model, "128x8:A100-80GB", global_batch_size=1536, seq_len=2048)
        depth_rows.append((layers, result.evaluated, f"{seconds:.3f}",
                           describe_best(result) if result.feasible else "infeasible"))
        print(f"  {layers:>4} layers: {result.evaluated:>7} configurations, {seconds:.3f} s")

    # 4. MoE models (expert parallelism and uneven stages in the space)
    moe = moe_rows(args.repeat)

    # 5. validation against published runs
    val_rows, val_moe, search_rows, png = validation_section(os.path.dirname(args.out))

    # 6. calibration
    table = megatron.calibration_table()
    print(megatron.format_table(table))
    opts = PlannerOptions()

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
               f"{platform.python_version()}, load average {load:.1f} at the end of the run: timings on a shared "
               f"machine are upper bounds")
    doc = f"""# Planner: results

Generated by `python -m tools.bench planner` on this machine ({machine}, OMP_NUM_THREADS=1).

## Speed

Planning LLaMA-2 70B on 1024 A100-80GB (`128x8:A100-80GB`), global batch 1536, sequence 4096, full search
over dp, tp, pp, vpp, the pipeline split (even / ends / balanced), sp, ZeRO stage 0-3, recompute
none/selective/full, micro-batch size and offload (and the expert-parallel degree for MoE models, below):

| what | valid configurations | priced | seconds |
|---|---|---|---|
| `ap.plan(...)` in-process, median of {args.repeat} | {headline_valid} | {headline.evaluated} | {headline_s:.3f} |
| `ap.plan(..., dualpipe=[0, 1])` in-process, DualPipe in the space too, median of {args.repeat} | | {dual.evaluated} | {dual_s:.3f} |
| `{' '.join(CLI)}` (whole process: interpreter, imports, search, explanation) | {headline_valid} | {headline.evaluated} | {cli_s:.2f} |

Best configuration: {describe_best(headline)}.

Mixture-of-experts models (expert-parallel degree, uneven stage splits and every other knob in the space;
median of {max(1, args.repeat // 2)}):

{md_table(("model", "cluster", "global batch", "valid configurations", "priced", "seconds",
           "seconds, every configuration priced", "best"), moe)}

Published search times for comparison: Alpa, GPT-39B about 40 minutes (compilation and profiling); Aceso about
200 s per GPT model on 32 GPUs; PyTorch's experimental per-op ILP auto-parallel about 50 s for Llama-3 8B on 64 GPUs.
Those systems search per-operator layouts; this planner searches the hybrid-parallel knobs with a closed-form
cost model, so the comparison is of the kind of answer, not of the same problem.

Growth with cluster size (LLaMA-2 70B, global batch 4096, seq 4096):

{md_table(("GPUs", "configurations", "seconds", "best"), size_rows)}

Growth with model depth (hidden 8192, 64 heads, vocab 51200, GPT-style; 1024 GPUs, global batch 1536, seq 2048):

{md_table(("layers", "configurations", "seconds", "best"), depth_rows)}

The search enumerates the structural knobs (dp, tp, pp, micro-batch, vpp, pipeline split, ep) in a small loop, expands the others
(sp, ZeRO stage, recompute, offload) as a cartesian product in numpy, prices the configurations at once with the
vectorised cost model, and ranks the memory-feasible ones. Before pricing it rules out the configurations that cannot
fit: a device's memory is, per stage, its weights, gradients and optimizer states (which depend on the ZeRO stage and
offload only) plus its activations (which depend on sp and recompute only), so `cost_model.memory_floors` bounds each
configuration from below twice, with its own (ZeRO, offload) and the least activations any (sp, recompute) gives, and
with its own (sp, recompute) and the least states any (ZeRO, offload) gives; a configuration above the device's
memory by either bound is infeasible whatever it is priced at. The ranking of the feasible configurations is
therefore unchanged (`tests/test_planner_pruning.py`: the same feasible plans in the same order with and without
pruning on every published job, and every ruled-out configuration priced above the device's memory). When nothing
fits, everything is priced, so the infeasibility report names the least-memory configuration of the whole space.
Its size grows with the number of divisors of the world size, of the global batch and of the layer count, not with
the device count itself. "configurations" in the growth tables above counts those priced.

## Calibration against Megatron-LM (Narayanan et al., SC'21, Table 1)

The cost model has two efficiency constants, fitted on two rows only ({', '.join(megatron.FIT_ROWS)}):
`gemm_efficiency` = {opts.gemm_efficiency} (sustained fraction of peak of the block matmuls) and
`activation_traffic_factor` = {opts.activation_traffic_factor} (bytes of device-memory traffic per stored
activation byte, i.e. the element-wise ops priced at memory bandwidth). Every other row is a prediction of the
published configuration: TP x PP as published, dp = GPUs / (TP·PP), the published global batch, sequence 2048,
vocabulary 51200, full recompute, no ZeRO, no sequence parallelism, interleaved schedule, scatter/gather of
stage-to-stage messages. Assumed (not in the table): micro-batch 1, and v = the smallest number > 1 of virtual
stages that divides a stage's layers.

{megatron.format_table(table)}

Largest error on the eight predicted rows: {100 * megatron.max_error(table):.1f}% (bound tested: 12%). The rise from
~137 to ~160 TFLOP/s comes out of the model, not a lookup: at small hidden sizes the memory-bound element-wise
work (Korthikanti's 34·s·b·h bytes per block) and the s/6h attention share weigh more against the h² matmuls;
the 18B row dips because it is the first with TP 8 (per-block all-reduces on NVLink, not hidden);
the large rows pay a pipeline bubble (p-1)/(v·m) of a few percent and stage-to-stage sends over InfiniBand.
The largest misses are the 7.5B and 18B rows (TP 4 and 8 without a pipeline), under-predicted: their per-block
all-reduces are priced at NVLink's achieved bus bandwidth (0.8 of nominal) and fully exposed, while Megatron-LM
overlaps part of them.

{planner_doc.validation_md(val_rows, val_moe, search_rows, png, args.out)}

{planner_doc.sweep_md()}
{planner_doc.model_md(opts)}
"""
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(doc)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
