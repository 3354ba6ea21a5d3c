"""Dispatch benchmark: per-op overhead of DistTensor ops, and a GPT DP2xTP2 training step against Paddle's
own semi-auto API on 4 gloo ranks.

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench dispatch [--steps 10] [--warmup 3] [--rounds 3]
                                                               [--profile-steps 2] [--op-repeats 1000] [--op-warmup 10]
                                                               [--skip-ops] [--skip-gpt]
                                                               [--out docs/dispatch_bench.md]

1. Per-op (this process): for add, matmul, linear, layer_norm, softmax, reshape, getitem and cross_entropy at
   two sizes, median times in interleaved rounds of: the paddle op (the callable taken before autoparallel
   patches paddle) on the DistTensors' own local shards and on contiguous copies of them, the patched entry
   point on the copies, and the call on the DistTensors. Meshes: one rank in the real world of one (pure
   dispatch cost, no communication) and a simulated 2x2 mesh (``ap.simulate(world_size=4)``: one call
   drives four shards; the paddle baseline is the op on each of the four shards).
2. GPT training step (tools/_bench_dispatch_worker.py): single process vs ours vs Paddle's
   ``paddle.distributed.shard_layer`` / ``shard_tensor`` / ``shard_optimizer``, both DP2xTP2 on 4 gloo
   ranks with the same model, weights, batch and placements: medians of the slowest rank's step time and
   of the CPU time of all ranks, the loss of every step compared with the single process, a per-phase
   split, our collectives per step and a CPU-time cProfile of rank 0 grouped by where the time goes.

Prints the tables and writes them, with the command, to ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import threading
import time


import numpy as np
import paddle

from autoparallel.mesh import ProcessMesh
from autoparallel.placement import parse_placements
from autoparallel.spec import DistSpec
from tools.bench.common import (ROOT, GPT_ARGS, add_int_args, fmt_bytes, git_commit, int_argv, interleaved_medians, launch,
                                md_table, progress, run_one, text_table, tool)

WORKER = tool("_bench_dispatch_worker.py")
NPROC = 4
SIZES = {"small": (16, 64), "medium": (256, 512)}         # (rows, hidden)
SIM_MESH = ([[0, 1], [2, 3]], ["data", "model"])


# ---- per-op cases ----------------------------------------------------------------------------------------
# op -> (paddle callable's dotted path, inputs, call(f, t)); inputs: name -> (shape from "r"ows/"h"idden,
# kind, placements on the simulated 2x2 mesh); kind "act": float activation (requires grad), "param":
# float parameter, "label": int64 class ids
def _reshape(f, t):
    b, h = t["x"].shape
    return f(t["x"], [b, h // 8, 8])


OPS = {
    "add": ("paddle.Tensor.__add__", {"x": ("rh", "act", "S(0),S(1)"), "y": ("rh", "act", "S(0),S(1)")},
            lambda f, t: f(t["x"], t["y"])),
    "matmul": ("paddle.matmul", {"x": ("rh", "act", "S(0),R"), "w": ("hh", "param", "R,S(1)")},
               lambda f, t: f(t["x"], t["w"])),
    "linear": ("paddle.nn.functional.linear",
               {"x": ("rh", "act", "S(0),R"), "w": ("hh", "param", "R,S(1)"), "b": ("h", "param", "R,S(0)")},
               lambda f, t: f(t["x"], t["w"], t["b"])),
    "layer_norm": ("paddle.nn.functional.layer_norm",
                   {"x": ("rh", "act", "S(0),R"), "g": ("h", "param", "R,R"), "b": ("h", "param", "R,R")},
                   lambda f, t: f(t["x"], t["x"].shape[-1:], t["g"], t["b"])),
    "softmax": ("paddle.nn.functional.softmax", {"x": ("rh", "act", "S(0),R")}, lambda f, t: f(t["x"], axis=-1)),
    "reshape": ("paddle.Tensor.reshape", {"x": ("rh", "act", "S(0),R")}, _reshape),
    "getitem": ("paddle.Tensor.__getitem__", {"x": ("rh", "act", "S(0),R")},
                lambda f, t: f(t["x"], (slice(None), slice(0, t["x"].shape[1] // 2)))),
    "cross_entropy": ("paddle.nn.functional.cross_entropy",
                      {"x": ("rh", "act", "S(0),R"), "y": ("r", "label", "S(0),R")},
                      lambda f, t: f(t["x"], t["y"])),
}


def resolve(path: str, dist_tensor_methods: bool = False):
    """The callable at ``path`` now (plain paddle before autoparallel patches it, its routed entry point
    after). ``dist_tensor_methods``: a ``paddle.Tensor`` method as a DistTensor has it (``x + y``,
    ``x.reshape(...)`` and ``x[...]`` on a DistTensor call these)."""
    if path.startswith("paddle.Tensor."):
        owner = paddle.Tensor
        if dist_tensor_methods:
            from autoparallel.dist_tensor import DistTensor as owner
        return getattr(owner, path.rsplit(".", 1)[1])
    obj = paddle
    for part in path.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def _shape(code, rows, hidden):
    return [{"r": rows, "h": hidden}[c] for c in code]


def make_arrays(op, rows, hidden, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for name, (code, kind, _) in OPS[op][1].items():
        shape = _shape(code, rows, hidden)
        out[name] = rng.integers(0, hidden, shape) if kind == "label" else \
            rng.standard_normal(shape).astype("float32")
    return out


def plain_tensor(arr, kind):
    t = paddle.to_tensor(arr)
    t.stop_gradient = kind == "label"
    return t


def param_tensor(arr):
    return paddle.create_parameter(list(arr.shape), "float32",
                                   default_initializer=paddle.nn.initializer.Assign(arr))


def local_inputs(op, arrays, mesh):
    """[{name: plain local shard}] for every rank of ``mesh`` (the simulated column's placements), or one
    entry holding the whole tensors when ``mesh`` is None."""
    inputs = OPS[op][1]
    if mesh is None:
        return [{n: plain_tensor(a, inputs[n][1]) for n, a in arrays.items()}]
    out = []
    for r in mesh.process_ids:
        c = mesh.coords_of(r)
        shard = {}
        for n, a in arrays.items():
            spec = DistSpec(mesh, parse_placements(inputs[n][2]), a.shape, str(a.dtype))
            shard[n] = plain_tensor(np.ascontiguousarray(a[spec.local_slices(c)]), inputs[n][1])
        out.append(shard)
    return out


def dist_inputs(op, arrays, mesh, simulated):
    import autoparallel as ap

    out = {}
    for n, a in arrays.items():
        _, kind, sim = OPS[op][1][n]
        placements = parse_placements(sim) if simulated else [ap.Replicate()] * mesh.ndim
        t = param_tensor(a) if kind == "param" else plain_tensor(a, kind)
        out[n] = ap.shard_tensor(t, mesh, placements)
    return out


# ---- timing ----------------------------------------------------------------------------------------------
def run_ops(args):
    """Per-op rows, timed in interleaved rounds: plain paddle (the callable taken before autoparallel
    patches paddle) on the DistTensor's own local shards and on contiguous copies of them, the patched
    entry point on the copies, and the call on the DistTensors."""
    from autoparallel import dispatch_handle, dist_tensor

    if dispatch_handle.installed():
        raise RuntimeError("autoparallel's dispatch is already installed: the plain baseline would be patched")
    raw_fn = {op: resolve(OPS[op][0]) for op in OPS}

    import autoparallel as ap

    sim_mesh = ProcessMesh(*SIM_MESH, create_groups=False)
    one = ap.ProcessMesh([0], ["x"])
    cases = [(mesh_kind, op, size) for mesh_kind in ("1 rank", "2x2 sim") for size in SIZES for op in OPS]
    rows = []
    for mesh_kind, op, size in progress(cases, desc="per-op overhead", unit="case"):
        path, _, call = OPS[op]
        arrays = make_arrays(op, *SIZES[size])
        copies = local_inputs(op, arrays, None if mesh_kind == "1 rank" else sim_mesh)
        sim = mesh_kind != "1 rank"
        with ap.simulate(world_size=4) if sim else contextlib.nullcontext():
            d = dist_inputs(op, arrays, ap.ProcessMesh(*SIM_MESH) if sim else one, simulated=sim)
            shards = [{n: dist_tensor.as_dist(v).local_of(r) for n, v in d.items()}
                      for r in sorted(dist_tensor.as_dist(d["x"]).locals)]
            f_raw, f_patched, f_ours = raw_fn[op], resolve(path), resolve(path, dist_tensor_methods=True)
            out = call(f_ours, d)
            us = interleaved_medians([lambda: [call(f_raw, t) for t in shards],
                                      lambda: [call(f_raw, t) for t in copies],
                                      lambda: [call(f_patched, t) for t in copies],
                                      lambda: call(f_ours, d)], args.op_warmup, args.op_repeats)
        rows.append({"mesh": mesh_kind, "op": op, "size": size, "shape": _shape_text(arrays),
                     "paddle_us": us[0], "contiguous_us": us[1], "patched_us": us[2], "ours_us": us[3],
                     "out": "[" + ", ".join(map(str, out.placements)) + "]",
                     "strided": any(not t.is_contiguous() for sh in shards for t in sh.values())})
    return rows


def _shape_text(arrays):
    return " ".join(f"{n}{list(a.shape)}" for n, a in arrays.items())


# ---- GPT step -------------------------------------------------------------------------------------------------
def model_args(args):
    return int_argv(args, [n for n, _ in GPT_ARGS] + ["warmup", "steps"])


def run_single(args, progress):
    return run_one(WORKER, ["--impl", "single", *model_args(args)], env={"AP_BENCH_PROGRESS": progress})


def run_ranks(args, impl, progress, profile):
    extra = ["--profile", args.profile_steps] if profile and args.profile_steps else []
    res = launch(WORKER, NPROC, ["--impl", impl, *model_args(args), *extra], timeout=900,
                 env={"AP_BENCH_PROGRESS": progress})
    return res[0]           # times and phases are already the slowest rank's; profile is rank 0's


def run_gpt(args):
    """single, then ``rounds`` x (paddle, ours) launches; step times pooled over rounds."""
    progress_file = os.path.join(tempfile.gettempdir(), f"ap_bench_dispatch_{os.getpid()}.progress")
    open(progress_file, "w").close()
    per_run = args.warmup + args.steps
    jobs = [("single", False)] + [(impl, r == args.rounds - 1) for r in range(args.rounds)
                                  for impl in ("paddle", "ours")]
    total = per_run * len(jobs) + (2 if args.profile_steps else 0)
    box = {"results": []}

    def target():
        try:
            for impl, profile in jobs:
                box["results"].append(run_single(args, progress_file) if impl == "single"
                                      else run_ranks(args, impl, progress_file, profile))
        except Exception as e:           # re-raised in the main thread
            box["error"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    with progress(total=total, desc="GPT step: single, then paddle / ours on 4 ranks", unit="step") as bar:
        while th.is_alive():
            th.join(0.5)
            lines = _read_lines(progress_file)
            if len(lines) != bar.n:
                bar.n = len(lines)
                bar.set_postfix_str(lines[-1] if lines else "")
                bar.refresh()
    os.remove(progress_file)
    if "error" in box:
        raise box["error"]
    merged = {}
    for r in box["results"]:
        m = merged.setdefault(r["impl"], {"impl": r["impl"], "losses": [], "times": [], "cpu": [], "phases": {},
                                          "layout": r["layout"]})
        m["losses"].append(r["losses"])
        m["times"] += r["times"]
        m["cpu"] += r["cpu"]
        for key in ("phases", "cpu_phases"):
            for k, v in r[key].items():
                m.setdefault(key, {}).setdefault(k, []).extend(v)
        for k in ("comm", "profile"):
            if r.get(k):
                m[k] = r[k]
    return merged


def _read_lines(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return f.read().splitlines()


# ---- tables ---------------------------------------------------------------------------------------------------
OP_HEADER = ["mesh", "op", "size", "inputs", "paddle µs", "ours µs", "overhead µs", "ours/paddle",
             "paddle, contiguous µs", "patched, plain µs", "ours out"]


def op_table(rows):
    out = []
    for r in rows:
        star = "*" if r["strided"] else ""
        out.append([r["mesh"], r["op"], r["size"], r["shape"], f"{r['paddle_us']:.1f}{star}", f"{r['ours_us']:.1f}",
                    f"{r['ours_us'] - r['paddle_us']:.1f}", f"{r['ours_us'] / r['paddle_us']:.2f}",
                    f"{r['contiguous_us']:.1f}", f"{r['patched_us']:.1f}", r["out"]])
    return out


def op_summary(rows):
    lines = []
    for mesh in ("1 rank", "2x2 sim"):
        sel = [r for r in rows if r["mesh"] == mesh]
        over = [r["ours_us"] - r["paddle_us"] for r in sel]
        tax = [r["patched_us"] - r["contiguous_us"] for r in sel]
        med = {s: statistics.median(r["ours_us"] / r["paddle_us"] for r in sel if r["size"] == s) for s in SIZES}
        lines.append(f"- {mesh}: overhead per DistTensor call median {statistics.median(over):.0f} µs "
                     f"(range {min(over):.0f} to {max(over):.0f}); median ours/paddle "
                     + ", ".join(f"{s} {v:.2f}" for s, v in med.items())
                     + f"; a plain-tensor call through the patched entry point costs {statistics.median(tax):+.1f} µs "
                     "(median) over the unpatched one.")
    strided = [r for r in rows if r["strided"]]
    if not strided:
        lines.append("- Every local shard made by `ap.shard_tensor` is contiguous (paddle on the shards and on "
                     "contiguous copies agree up to noise).")
    else:
        worst = max(strided, key=lambda r: r["paddle_us"] / r["contiguous_us"])
        lines.append(f"- `*`: some local shards made by `ap.shard_tensor` are strided views (not contiguous): "
                     f"{len(strided)} cases; the same paddle call on contiguous copies is up to "
                     f"{worst['paddle_us'] / worst['contiguous_us']:.1f}x faster ({worst['op']} {worst['size']}: "
                     f"{worst['paddle_us']:.0f} vs {worst['contiguous_us']:.0f} µs).")
    return lines


def ms(values):
    return f"{statistics.median(values) * 1e3:.0f}"


def gpt_tables(m):
    single, pad, ours = m["single"], m["paddle"], m["ours"]
    ref = single["losses"][0]
    med = {k: statistics.median(v["times"]) for k, v in m.items()}
    cpu = {k: statistics.median(v["cpu"]) for k, v in m.items()}
    rows = []
    labels = {"single": "single process, plain paddle", "paddle": "Paddle semi-auto (shard_layer/shard_tensor)",
              "ours": "ours (ap.apply_tp + shard_layer + shard_optimizer)"}
    for key, ranks in (("single", 1), ("paddle", 4), ("ours", 4)):
        r = m[key]
        t = r["times"]
        diff = max(abs(a - b) for run in r["losses"] for a, b in zip(run, ref))
        rows.append([labels[key], ranks, len(t), ms(t), f"{min(t) * 1e3:.0f}-{max(t) * 1e3:.0f}",
                     f"{med[key] / med['single']:.2f}", ms(r["cpu"]), f"{cpu[key] / cpu['single']:.2f}",
                     f"{r['losses'][0][0]:.6f}", f"{r['losses'][0][-1]:.6f}", f"{diff:.1e}"])
    header = ["run", "ranks", "timed steps", "median step ms", "min-max ms", "vs single", "CPU ms/step (all ranks)",
              "CPU vs single", "step-0 loss", f"loss after {len(ref) - 1} steps", "max abs(loss - single), all steps"]
    phase_rows = []
    for k in single["phases"]:
        w = [statistics.median(x["phases"][k]) * 1e3 for x in (single, pad, ours)]
        c = [statistics.median(x["cpu_phases"][k]) * 1e3 for x in (single, pad, ours)]
        phase_rows.append([k] + [f"{v:.1f}" for v in w] + [f"{w[2] - w[1]:+.1f}"] + [f"{v:.1f}" for v in c]
                          + [f"{c[2] - c[1]:+.1f}"])
    phase_header = ["phase", "wall: single", "paddle", "ours", "ours - paddle", "CPU: single", "paddle", "ours",
                    "ours - paddle"]
    same_layout = ours["layout"] == pad["layout"]
    return header, rows, phase_header, phase_rows, (med["ours"] / med["paddle"], cpu["ours"] / cpu["paddle"]), \
        same_layout


def comm_lines(ours):
    """One line per phase: how many collectives of which size (bytes each rank sent)."""
    lines = []
    for phase, calls in (ours.get("comm") or {}).items():
        kinds = {}
        for name, nbytes, group in calls:
            kinds[(name, nbytes, group)] = kinds.get((name, nbytes, group), 0) + 1
        text = " + ".join(f"{n} x {name} of {fmt_bytes(b)} over {g} ranks" for (name, b, g), n in kinds.items())
        plural = "" if len(calls) == 1 else "s"
        lines.append(f"- {phase}: {len(calls)} collective{plural}" + (f": {text}" if text else ""))
    total = sum(len(c) for c in (ours.get("comm") or {}).values())
    sent = sum(b for c in (ours.get("comm") or {}).values() for _, b, _ in c)
    return lines + [f"- per step: {total} collectives, {fmt_bytes(sent)} sent by each rank"] if lines else []


def profile_tables(m):
    prof = {k: m[k].get("profile") for k in ("paddle", "ours")}
    if not all(prof.values()):
        return None
    groups = sorted(set(prof["paddle"]["groups"]) | set(prof["ours"]["groups"]),
                    key=lambda g: -prof["ours"]["groups"].get(g, 0.0))
    grows = [[g, f"{prof['paddle']['groups'].get(g, 0.0) * 1e3:.1f}", f"{prof['ours']['groups'].get(g, 0.0) * 1e3:.1f}"]
             for g in groups]
    grows.append(["total (profiled)", f"{prof['paddle']['total'] * 1e3:.1f}", f"{prof['ours']['total'] * 1e3:.1f}"])
    top = [[f"{tt * 1e3:.2f}", f"{ct * 1e3:.2f}", f"{n:g}", f"`{where}`"] for tt, ct, n, where in prof["ours"]["top"]]
    return (["CPU own time (rank 0, per step)", "paddle ms", "ours ms"], grows,
            ["own CPU ms/step", "cumulative CPU ms/step", "calls/step", "function (ours, rank 0)"], top)


# ---- output -----------------------------------------------------------------------------------------------------
def write_doc(path, command, args, op_rows, gpt, load):
    env = (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
           f"paddle {paddle.__version__}, OMP_NUM_THREADS=1; 1-minute load average {load[0]:.1f} before and "
           f"{load[1]:.1f} after the run")
    parts = [f"""# Dispatch benchmark: DistTensor op overhead, and a GPT DP2xTP2 step against Paddle's semi-auto API

Generated by `python -m tools.bench dispatch` at commit {git_commit()} on this machine ({env}). Command:

```
{command}
```
"""]
    if op_rows:
        parts.append(f"""## 1. Per-op overhead

One process. For every op and size, four variants timed in interleaved rounds (each round times every
variant in turn, so drift and background load hit them alike): {args.op_warmup} warm-up calls each, then
up to {args.op_repeats} timed calls each (about 0.3 s per variant, in 10 rounds), garbage collector off while
timing; the table shows the median call. Float inputs require gradients as activations and parameters do in training
(parameters are paddle Parameters, so ours holds them as `DistParameter`s). Forward only: backward runs
in paddle's autograd on the local tensors (and the collectives' adjoints), without dispatch.

- **paddle µs**: the paddle op on the DistTensors' own local shards, through the callable taken before
  autoparallel patches paddle (`paddle.Tensor.__add__`, `paddle.matmul`, `F.linear`, ...; see `OPS` in
  the tool). On `2x2 sim` it is the op on each of the four ranks' shards (four calls).
- **ours µs**: the call on the DistTensors: rule -> reshard (none needed here) -> local op on each held
  shard -> DistTensor. **overhead** = ours - paddle, on the same local tensors: the dispatch cost.
- **paddle, contiguous µs**: the unpatched op on contiguous copies of the shards; `*` on the paddle
  column marks cases where some shard made by `ap.shard_tensor` is a strided view.
- **patched, plain µs**: the contiguous copies through the patched entry point: what a plain-tensor op
  pays while autoparallel is active. **ours out**: the output placements the rule chose.
- **1 rank**: a one-rank mesh in the real world of one, every input `[R]`: pure dispatch cost.
  **2x2 sim**: `ap.simulate(world_size=4)` on a 2x2 mesh ("data", "model"); inputs placed as in a
  DP2xTP2 step (activations `[S(0), R]` or `[S(0), S(1)]`, column-parallel weight `[R, S(1)]`, bias
  `[R, S(0)]`): one dispatch drives four local calls.

{md_table(OP_HEADER, op_table(op_rows))}

{chr(10).join(op_summary(op_rows))}
""")
    if gpt:
        header, rows, ph, prow, ratio, same_layout = gpt_tables(gpt)
        layout = gpt["ours"]["layout"]
        sharded = ", ".join(f"`{n}` {p}" for n, p in layout.items() if "S(" in p and n.startswith(
            ("wte", "lm_head", "blocks.0.")))
        parts.append(f"""## 2. GPT training step, DP2xTP2 on 4 gloo ranks

GPT (`examples/models/gpt.py`): vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, {args.heads} heads,
sequence {args.seq}, global batch {args.batch}; AdamW (lr 1e-3); float32; the same seed (same initial weights) and the
same fixed batch every step. A step is forward + `F.cross_entropy` + backward + `opt.step()` +
`opt.clear_grad()` + `float(loss)` (the same `train_step` code for all three runs). {args.warmup} warm-up steps,
then {args.steps} timed steps per launch, each after a barrier; a step's time is the slowest rank's, its CPU
time the sum over ranks of `time.process_time()` (the work done, which other load on the machine disturbs
far less than wall time); the 4-rank runs are launched {args.rounds} times alternately (paddle, ours,
paddle, ...) and their timed steps pooled. The single process runs alone on one core; the 4 ranks share
the machine's {os.cpu_count()} cores.

Mesh `[[0, 1], [2, 3]]` ("data", "model"); ids and labels `[Shard(0), Replicate()]`; tensor-parallel
placements from `autoparallel.testing.models.GPT_PLAN` on the "model" dim for both runs: qkv/fc1 weight
`S(1)` and bias `S(0)` (column-parallel), proj/fc2 weight `S(0)` (row-parallel), `lm_head` weight `S(1)`
(vocab-parallel logits into `F.cross_entropy`), `wte` weight `S(0)` (vocab-parallel embedding: Paddle 3.3.1
runs it on CPU, so it is sharded in both runs), everything else replicated. Ours applies them with
`ap.apply_tp(model, mesh, tp_plan("gpt"), "model")` + `ap.shard_layer` + `ap.shard_optimizer(AdamW)`;
Paddle's with `paddle.distributed.shard_layer(model, mesh, shard_fn)` (every parameter placed by
`shard_fn`), `dist.shard_tensor` for the batch and `dist.shard_optimizer(AdamW)`. Parameter placements of
the two runs identical: **{"yes" if same_layout else "NO"}** (e.g. {sharded}).

{md_table(header, rows)}

**ours / paddle: {ratio[0]:.2f} (median step time), {ratio[1]:.2f} (median CPU time per step, all ranks)**

Per phase, in ms: **wall** is the median over timed steps of the slowest rank's phase time (the phases of a
step need not come from the same rank, so they need not add up to the step; a phase that ends in a
collective also absorbs the wait for ranks still busy with the previous phase); **CPU** is the median of
the process CPU time summed over the ranks (gloo waits block without using CPU, so this is the work done:
compute, python, copies).

{md_table(ph, prow)}

Our collectives in one step, by phase (counted on rank 0 by wrapping `paddle.distributed`,
`autoparallel/comm/counter.py`; bytes are what each rank sends, by the ring convention; Paddle's run inside
its C++ ops and cannot be counted this way):
{chr(10).join(comm_lines(gpt["ours"])) or "- (not counted)"}
""")
        prof = profile_tables(gpt)
        if prof:
            gh, grows, th, trows = prof
            parts.append(f"""### Where the time goes (cProfile, rank 0, {args.profile_steps} steps after timing)

cProfile with a CPU-time clock (`time.process_time`): ms of CPU per step, by the function's own time,
grouped by where the code lives. Waiting in a collective blocks without CPU, so waits do not appear here
(the wall columns of the phase table show them). Profiling inflates python code more than kernels, so
compare the groups between the two runs rather than the totals with the tables above. Paddle's collectives
and reshards run inside its C++ ops, so for Paddle they are part of its kernels and autograd engine.

{md_table(gh, grows)}

Top functions of ours by own time:

{md_table(th, trows)}
""")
    parts.append(f"""Notes: with 4 ranks on {os.cpu_count()} cores the 4-rank wall times are noisy and their speed-up
over one process is bounded by the cores; other load on the machine (see the load average above) moves wall
times far more than CPU times. Compare ratios, not absolute times. On gloo `sync_op=False` still blocks,
so neither implementation overlaps communication with compute.
""")
    with open(path, "w") as f:
        f.write("\n".join(parts))


GPT_OPTIONS = ("steps", "warmup", "rounds", "profile_steps") + tuple(name for name, _ in GPT_ARGS)
OP_OPTIONS = ("op_repeats", "op_warmup")


def unused_options(p, args) -> str:
    """Why the options given cannot all act ('' when they can): a skipped part takes no options."""
    if args.skip_ops and args.skip_gpt:
        return "--skip-ops and --skip-gpt together leave nothing to measure"
    for skipped, names in (("skip_gpt", GPT_OPTIONS), ("skip_ops", OP_OPTIONS)):
        given = ["--" + n.replace("_", "-") for n in names if getattr(args, n) != p.get_default(n)]
        if getattr(args, skipped) and given:
            return f"--{skipped.replace('_', '-')} skips the part that {', '.join(given)} set"
    return ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed GPT steps per launch")
    p.add_argument("--warmup", type=int, default=3, help="untimed GPT steps first")
    p.add_argument("--rounds", type=int, default=3, help="launches of each 4-rank run (alternating)")
    p.add_argument("--profile-steps", dest="profile_steps", type=int, default=2,
                   help="cProfile this many extra steps on rank 0 of the last launches (0: off)")
    p.add_argument("--op-repeats", dest="op_repeats", type=int, default=1000,
                   help="max timed calls per op and variant")
    p.add_argument("--op-warmup", dest="op_warmup", type=int, default=10, help="untimed calls per op and variant")
    add_int_args(p, GPT_ARGS)
    p.add_argument("--skip-ops", dest="skip_ops", action="store_true", help="skip the per-op part")
    p.add_argument("--skip-gpt", dest="skip_gpt", action="store_true", help="skip the GPT step part")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "dispatch_bench.md"),
                   help="markdown file to write ('' to skip)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1 or args.batch % 2 or args.heads % 2:
        p.error("expected --steps >= 1, --warmup >= 0, --rounds >= 1 and even --batch and --heads (DP2xTP2)")
    unused = unused_options(p, args)
    if unused:
        p.error(unused)
    os.environ["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    load_before = os.getloadavg()[0]

    op_rows = [] if args.skip_ops else run_ops(args)
    if op_rows:
        print(text_table(OP_HEADER, op_table(op_rows)))
        print("\n".join(op_summary(op_rows)))
        print(f"per-op part: {time.perf_counter() - start:.0f} s\n")
    gpt_start = time.perf_counter()
    gpt = None if args.skip_gpt else run_gpt(args)
    if gpt:
        print(f"GPT part: {time.perf_counter() - gpt_start:.0f} s")
        header, rows, ph, prow, ratio, same_layout = gpt_tables(gpt)
        print(text_table(header, rows))
        print(f"ours / paddle: {ratio[0]:.2f} (median step time), {ratio[1]:.2f} (CPU time per step); "
              f"same parameter placements: {same_layout}\n")
        print(text_table(ph, prow))
        print("\n".join(comm_lines(gpt["ours"])))
        prof = profile_tables(gpt)
        if prof:
            print("\n" + text_table(prof[0], prof[1]) + "\n\n" + text_table(prof[2], prof[3]))
    print(f"total {time.perf_counter() - start:.0f} s; 1-minute load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    if args.out:
        defaults = {a.dest: a.default for a in p._actions}
        flags = [f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                 if k not in ("out", "skip_ops", "skip_gpt") and v != defaults[k]]
        flags += [f" --{k.replace('_', '-')}" for k in ("skip_ops", "skip_gpt") if getattr(args, k)]
        command = "OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench dispatch" + "".join(flags)
        write_doc(args.out, command, args, op_rows, gpt, (load_before, os.getloadavg()[0]))
        print(f"wrote {os.path.relpath(args.out, os.getcwd())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
