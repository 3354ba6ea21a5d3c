"""Reshard benchmark on 4 gloo ranks: ours (``ap.reshard``) against Paddle's ``paddle.distributed.reshard``.

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench reshard [--sizes 256,1024,2048] [--repeats 11]
                                                              [--warmup 3] [--out docs/reshard_bench.md]

Launches tools/_bench_reshard_worker.py with ``python -m paddle.distributed.launch`` on 4 ranks. Per
(transition, size): the median over repeats of the slowest rank's time for ours and for Paddle's, the
bytes each rank sent by ours (counted by wrapping ``paddle.distributed``) next to the plan's
``bytes_per_rank``, both results checked against the full tensor, and a single-process reference: one
process holding every rank's source shard builds rank 0's destination shard with numpy. Prints the table
and writes it, with the command, to ``--out``.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import threading
import time


import numpy as np

from tools._bench_reshard_worker import CASES, MESHES, full_tensor
from reshard.units import fmt_bytes
from tools.bench.common import ROOT, launch, md_table, progress, text_table, tool

WORKER = tool("_bench_reshard_worker.py")
NPROC = 4


# ---- single-process reference ----------------------------------------------------------------------
def _source_locals(x, spec):
    """Every rank's source shard as numpy (Partial(sum): coordinate 0 holds the value, zeros elsewhere)."""
    out = {}
    for r in spec.mesh.process_ids:
        c = spec.mesh.coords_of(r)
        t = np.ascontiguousarray(x[spec.local_slices(c)])
        if any(c[i] != 0 for i in spec.partial_mesh_dims()):
            t = np.zeros_like(t)
        out[r] = t
    return out


def reference_fn(x, src_spec, dst_spec, rank=0):
    """A function building ``rank``'s destination shard in one process from the source shards it needs:
    block copies for Shard/Replicate sources, sums over the terms of Partial ones."""
    mesh = src_spec.mesh
    me = mesh.coords_of(rank)
    locals_ = _source_locals(x, src_spec)
    dsl = dst_spec.local_slices(me)
    shape = tuple(s.stop - s.start for s in dsl)
    partial = bool(src_spec.partial_mesh_dims())
    jobs = []
    for r in mesh.process_ids:
        c = mesh.coords_of(r)
        # a replicated mesh dim: read our own copy; a sharded or partial one: every coordinate
        if any(c[i] != me[i] for i, p in enumerate(src_spec.placements) if p.is_replicate()):
            continue
        ssl = src_spec.local_slices(c)
        inter = [slice(max(a.start, b.start), min(a.stop, b.stop)) for a, b in zip(ssl, dsl)]
        if any(s.stop <= s.start for s in inter):
            continue
        out_idx = tuple(slice(s.start - d.start, s.stop - d.start) for s, d in zip(inter, dsl))
        in_idx = tuple(slice(s.start - a.start, s.stop - a.start) for s, a in zip(inter, ssl))
        jobs.append((locals_[r], in_idx, out_idx))

    def run():
        out = np.zeros(shape, dtype=x.dtype) if partial else np.empty(shape, dtype=x.dtype)
        for src, in_idx, out_idx in jobs:
            if partial:
                out[out_idx] += src[in_idx]
            else:
                out[out_idx] = src[in_idx]
        return out

    return run


def reference_seconds(mesh_key, src_s, dst_s, size, repeats):
    from autoparallel.mesh import ProcessMesh
    from autoparallel.placement import parse_placements
    from autoparallel.spec import DistSpec
    from autoparallel.testing.check import expected_local

    ranks = MESHES[mesh_key]
    mesh = ProcessMesh(ranks, dim_names=["x", "y"][:np.ndim(ranks)], create_groups=False)
    x = full_tensor(size)
    src = DistSpec(mesh, parse_placements(src_s), x.shape, "float32")
    dst = DistSpec(mesh, parse_placements(dst_s), x.shape, "float32")
    fn = reference_fn(x, src, dst)
    got = fn()
    if not dst.partial_mesh_dims() and not np.allclose(got, expected_local(x, dst, mesh.coords_of(0))):
        raise AssertionError(f"reference for {src_s} -> {dst_s} built the wrong shard")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- the distributed run, with progress ---------------------------------------------------------------
def run_ranks(args, total):
    progress_file = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ap_bench_reshard_{os.getpid()}.progress")
    box = {}

    def target():
        try:
            box["results"] = launch(WORKER, NPROC, ["--sizes", args.sizes, "--repeats", args.repeats,
                                                    "--warmup", args.warmup],
                                    timeout=900, env={"AP_BENCH_PROGRESS": progress_file}, attempts=5)
        except Exception as e:  # re-raised in the main thread
            box["error"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    with progress(total=total, desc=f"reshard bench on {NPROC} ranks", unit="case") as bar:
        while th.is_alive():
            th.join(0.5)
            done = _lines(progress_file)
            if done != bar.n:
                bar.n = done
                if done:
                    bar.set_postfix_str(_last_line(progress_file))
                bar.refresh()
    if os.path.exists(progress_file):
        os.remove(progress_file)
    if "error" in box:
        raise box["error"]
    return box["results"]


def _lines(path):
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for _ in f)


def _last_line(path):
    with open(path) as f:
        lines = f.read().splitlines()
    return lines[-1] if lines else ""


# ---- table --------------------------------------------------------------------------------------------
def ms(s):
    return f"{s * 1e3:.3g}"


def build_rows(results, args):
    rows, ratios, byte_checks, failures = [], [], [], []
    per_rank = list(zip(*results))
    for ranked in progress(per_rank, desc="single-process reference", unit="case"):
        r0 = ranked[0]
        ours, paddle = r0["ours"], r0["paddle"]
        name = f"{r0['src']} -> {r0['dst']}"
        sent = [rr["ours"]["bytes_sent"] for rr in ranked]
        bytes_ok = all(s == ours["plan_bytes"] for s in sent)
        byte_checks.append(bytes_ok)
        ref = reference_seconds(r0["mesh"], r0["src"], r0["dst"], r0["size"],
                                max(5, int(args.repeats)))
        if "unsupported" in paddle:
            p_ms, ratio, p_ok = "paddle: unsupported on CPU", "-", None
        else:
            p_ms, p_ok = ms(paddle["seconds"]), paddle["ok"]
            ratio_v = ours["seconds"] / paddle["seconds"]
            ratios.append((r0["size"], ratio_v))
            ratio = f"{ratio_v:.2f}"
        status = []
        if not ours["ok"]:
            status.append("MISMATCH ours")
            failures.append(f"ours {r0['mesh']} {name} {r0['size']}")
        if p_ok is False:
            status.append("MISMATCH paddle")
            failures.append(f"paddle {r0['mesh']} {name} {r0['size']}")
        if not bytes_ok:
            status.append(f"bytes differ from plan: {sorted(set(sent))}")
        sent_txt = fmt_bytes(max(sent)) + ("" if len(set(sent)) == 1 else " (max)")
        rows.append([r0["mesh"], name, f"{r0['size']}x{r0['size']}", ms(ours["seconds"]), p_ms, ratio, ms(ref),
                     sent_txt, fmt_bytes(ours["plan_bytes"]), " + ".join(ours["plan"]),
                     "; ".join(status) or "ok"])
    unsupported = sorted({(r[0]["paddle"]["unsupported"]) for r in per_rank if "unsupported" in r[0]["paddle"]})
    return rows, ratios, byte_checks, failures, unsupported


HEADER = ["mesh", "transition", "size", "ours ms", "paddle ms", "ours/paddle", "1-proc ref ms",
          "sent/rank (counted)", "plan bytes/rank", "our plan", "check"]


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summary_lines(ratios, byte_checks, failures, n_rows):
    values = [r for _, r in ratios]
    sizes = sorted({s for s, _ in ratios})
    by_size = ", ".join(f"{s}x{s}: {_geomean([r for z, r in ratios if z == s]):.2f}" for s in sizes)
    lines = [f"- Cases: {n_rows}; Paddle runs {len(values)} of them on CPU. Geometric mean of ours/paddle over "
             f"those: {_geomean(values):.2f} (median {statistics.median(values):.2f}, range "
             f"{min(values):.2f}-{max(values):.2f}); by size: {by_size}."
             if values else f"- Cases: {n_rows}; Paddle runs none of them on CPU.",
             f"- Bytes sent by ours, counted on every rank, equal the plan's bytes_per_rank in "
             f"{sum(byte_checks)}/{len(byte_checks)} cases.",
             "- Every result (ours and Paddle's) equals the full tensor on every rank." if not failures else
             "- MISMATCHES: " + "; ".join(failures)]
    return lines


def write_doc(path, command, table, summary, unsupported, args, load):
    text = f"""# Reshard benchmark: ours vs `paddle.distributed.reshard` on 4 gloo ranks

Generated by `python -m tools.bench reshard` on this machine ({platform.machine()}, {os.cpu_count()} cores,
Python {platform.python_version()}, paddle {_paddle_version()}, OMP_NUM_THREADS=1 per rank; 1-minute load
average {load[0]:.2f} before the run and {load[1]:.2f} after). Command:

```
{command}
```

4 ranks on one machine, gloo over loopback. For every (transition, size), float32 square tensors: warm-up
{args.warmup}, then {args.repeats} timed repeats, each after a barrier; each repeat keeps the slowest rank's time and
the table shows the median. Both implementations start from the same full tensor (`ap.shard_tensor` /
`paddle.distributed.shard_tensor`, untimed); the timed call is `ap.reshard(...)` or
`paddle.distributed.reshard(...)`.

Columns: **ours/paddle** is the time ratio (below 1: ours is faster). **1-proc ref** is a single-process
reference: one process that already holds every rank's source shard builds rank 0's destination shard
with numpy (block copies; sums over the terms of a Partial source), i.e. the data movement without any
communication. **sent/rank (counted)** is what each rank sent in ours, counted by wrapping the
`paddle.distributed` calls (`autoparallel/comm/counter.py`); **plan bytes/rank** is `plan.bytes_per_rank`
for the plan our runtime executes (priced for gloo: emulated collectives cost what their emulation sends).
**check** compares every rank's result, ours and Paddle's, with the full tensor (Partial destinations:
the value reduced back to replicate) and the counted bytes with the plan.

{table}

{chr(10).join(summary)}

"paddle: unsupported on CPU": Paddle 3.3.1 has no CPU (gloo) kernel for the collective its reshard needs:
{chr(10).join('- `' + u + '`' for u in unsupported) or '- (none in this run)'}

Ours runs those through emulations from the capability table (`autoparallel/comm/capabilities.py`):
reduce_scatter as all_reduce + slice, all_to_all as pairwise send/recv in perfect-matching rounds.

Notes: with 4 ranks on {os.cpu_count()} cores the timings are noisy (ranks share cores, and a load average
well above 0 means other work shared them too); compare ratios, not absolute times. On gloo `sync_op=False` still blocks, so neither implementation overlaps communication.
"""
    with open(path, "w") as f:
        f.write(text)


def _paddle_version():
    try:
        import paddle
        return paddle.__version__
    except Exception:
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256,1024,2048", help="square tensor sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=11, help="timed repeats per case (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs before timing")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "reshard_bench.md"),
                   help="markdown file to write ('' to skip)")
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes: expected comma-separated integers, got {args.sizes!r}")
    if min(sizes) < 1:
        p.error(f"--sizes must be positive, got {args.sizes}")
    if int(args.repeats) < 1 or int(args.warmup) < 0:
        p.error(f"expected --repeats >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    os.environ["OMP_NUM_THREADS"] = "1"
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    results = run_ranks(args, total=len(sizes) * len(CASES))
    load_after = os.getloadavg()[0]
    rows, ratios, byte_checks, failures, unsupported = build_rows(results, args)
    summary = summary_lines(ratios, byte_checks, failures, len(rows))
    print(text_table(HEADER, rows))
    print("\n".join(summary))
    print(f"total {time.perf_counter() - start:.0f} s; load average {load_before:.2f} before, {load_after:.2f} after")
    if args.out:
        command = "OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench reshard" + "".join(
            f" --{k} {v}" for k, v in (("sizes", args.sizes), ("repeats", args.repeats), ("warmup", args.warmup))
            if v != p.get_default(k))
        write_doc(args.out, command, md_table(HEADER, rows), summary, unsupported, args, (load_before, load_after))
        print(f"wrote {os.path.relpath(args.out, os.getcwd())}")
    return 1 if failures or not all(byte_checks) else 0


if __name__ == "__main__":
    sys.exit(main())
