"""``autoparallel calibrate``: measure this machine into a CPU/gloo cluster profile (JSON).

By default it launches ``--ranks`` real ranks (``python -m paddle.distributed.launch``, the worker is
planner/calib_worker.py) and, with every rank busy at once as in training:

* times each collective over gloo through autoparallel's comm layer (all_reduce, all_gather, broadcast,
  send/recv, and the emulated reduce_scatter and all_to_all) for groups of 2 and of all ranks (every group
  of that size at once), at a few message sizes, each call right after a burst of eager ops as training
  issues them, and fits ``t = alpha + bytes / bandwidth`` per collective and group size by non-negative
  least squares of the relative errors;
* measures the eager runtime's per-op costs (a plain op, a dispatched forward op and its backward on a
  tiny transformer language model's op mix, an AdamW update per parameter tensor), float32 matmul FLOP/s
  and copy bandwidth of one rank.

Every figure is the mean over repetitions of the slowest rank's time (a synchronous step waits for the
slowest rank; on shared cores the ranks drift apart).

The profile is a ClusterSpec with backend "gloo", overlap 0 (gloo's sync_op=False blocks), one node of
``--ranks`` devices sharing the machine's memory, precision fp32 and gemm_efficiency 1 (a measured rate
is already sustained); ``autoparallel plan --cluster profile.json`` and ``ap.plan(..., cluster=path)`` use
it. ``--no-launch`` measures in this process only (no collectives: the profile then carries an assumed
loopback link and says so in ``extra``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from autoparallel.cli_checks import bounded, output_path
from autoparallel.core.cluster import ClusterSpec, CollectiveFit, DeviceSpec, LinkSpec, RuntimeSpec

# placeholders for gloo over loopback TCP when collectives are not measured (--no-launch)
ASSUMED_GLOO_LINK = LinkSpec(latency_s=5e-5, bandwidth_Bps=1e9)
SIZES = (64, 65536, 1048576, 4194304)               # bytes per rank of the collective messages
QUICK_SIZES = (64, 262144, 1048576)
COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_to_all", "send_recv")
UNBOUNDED_BANDWIDTH = 1e15                           # a fit whose slope is zero (noise hid the bytes term)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calib_worker.py")


# ---- in-process measurements ------------------------------------------------------------------------
def _best_of(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul_flops(n: int = 1024, repeat: int = 5, use_paddle: bool = True):
    """(FLOP/s, engine) of an n x n x n float32 matmul, best of ``repeat`` after a warm-up."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)
    engine = "numpy"
    fn = lambda: a @ b                                     # noqa: E731
    if use_paddle:
        try:
            import paddle
            pa, pb = paddle.to_tensor(a), paddle.to_tensor(b)
            fn = lambda: paddle.matmul(pa, pb).numpy()     # noqa: E731  (numpy() waits for the result)
            engine = "paddle"
        except Exception:                                  # paddle missing or unusable: numpy measures the BLAS
            pass
    fn()
    seconds = _best_of(fn, repeat)
    return 2.0 * n ** 3 / seconds, engine


def measure_memory_bandwidth(megabytes: int = 256, repeat: int = 5) -> float:
    """Bytes/s of a large array copy (one read and one write of every byte)."""
    src = np.ones(megabytes * 2 ** 20 // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    seconds = _best_of(lambda: np.copyto(dst, src), repeat)
    return 2.0 * src.nbytes / seconds


def host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8e9


# ---- profiles ---------------------------------------------------------------------------------------
def cpu_profile(flops: float, memory_bandwidth_Bps: float, memory_bytes: float, ranks: int,
                name: str = "cpu", link: LinkSpec = ASSUMED_GLOO_LINK, extra=(), collectives=(),
                runtime: RuntimeSpec = None) -> ClusterSpec:
    """A one-node gloo ClusterSpec of ``ranks`` CPU 'devices' sharing the machine's memory and bandwidth
    (``memory_bandwidth_Bps`` is the machine's; each rank gets 1/ranks of it and of ``memory_bytes``)."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks <= 0:
        raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
    device = DeviceSpec(f"{name}-rank", (("float32", flops), ("bfloat16", flops), ("float16", flops)),
                        memory_bytes / ranks, memory_bandwidth_Bps / ranks)
    measured = "measured" if collectives else "assumed"
    facts = (("precision", "fp32"), ("gemm_efficiency", 1.0), ("collectives", measured)) + tuple(extra)
    return ClusterSpec(f"1x{ranks}:{name}", 1, ranks, device, link, link, backend="gloo", overlap=0.0, extra=facts,
                       collectives=tuple(collectives), runtime=runtime)


def fit_weights(times) -> np.ndarray:
    """Relative-error weights 1/t (message sizes span five orders of magnitude: every size counts alike)."""
    t = np.asarray(times, dtype=float)
    floor = max(float(t.max()), 1e-12) * 1e-3
    return 1.0 / np.maximum(t, floor)


def fit_alpha_beta(points):
    """(latency_s, bandwidth_Bps) of ``t = alpha + bytes / bandwidth`` by non-negative least squares of the
    relative errors."""
    from scipy.optimize import nnls

    pts = np.asarray(points, dtype=float).reshape(-1, 2)
    if len(pts) < 2:
        raise ValueError(f"fitting latency and bandwidth needs at least two message sizes, got {len(pts)}")
    w = fit_weights(pts[:, 1])
    design = np.stack([np.ones(len(pts)), pts[:, 0]], axis=1) * w[:, None]
    (alpha, slope), _ = nnls(design, pts[:, 1] * w)
    return float(alpha), (1.0 / slope if slope > 1.0 / UNBOUNDED_BANDWIDTH else UNBOUNDED_BANDWIDTH)


def runs(results) -> list:
    """Split worker results (possibly several launches concatenated) into runs of one launch each."""
    world = int(results[0]["world"])
    if len(results) % world:
        raise ValueError(f"expected whole runs of {world} ranks, got {len(results)} results")
    return [results[i:i + world] for i in range(0, len(results), world)]


def slowest(run, get) -> np.ndarray:
    """Per repetition, the slowest rank's seconds (a synchronous step waits for it): ``get(rank result)``
    gives one rank's per-repetition list."""
    return np.max(np.stack([np.asarray(get(r), dtype=float) for r in run]), axis=0)


def pooled(results, get) -> float:
    """Mean over the repetitions of every run of the slowest rank's seconds."""
    return float(np.mean(np.concatenate([slowest(run, get) for run in runs(results)])))


def collective_points(results, key):
    """[[bytes, seconds a call adds after the eager burst]] of one collective and group size: mean of the
    slowest rank's (burst + call) minus mean of the slowest rank's burst alone, never negative."""
    entry = results[0]["collectives"][key]
    work = pooled(results, lambda r: r["collectives"][key]["work"])
    points = []
    for i, nbytes in enumerate(entry["bytes"]):
        after = pooled(results, lambda r: r["collectives"][key]["after"][i])
        points.append([float(nbytes), max(after - work, 0.0) * entry["factor"]])
    return points


def collective_fits(results) -> tuple:
    """CollectiveFits of every measured collective and group size (``name/n`` keys of the worker)."""
    fits = []
    for key in sorted(results[0]["collectives"]):
        name, n = key.split("/")
        alpha, bandwidth = fit_alpha_beta(collective_points(results, key))
        fits.append(CollectiveFit(name, int(n), alpha, bandwidth))
    return tuple(fits)


def runtime_costs(results) -> RuntimeSpec:
    """Per-op costs from the slowest rank of every repetition."""
    rt = results[0]["runtime"]
    per = lambda key: pooled(results, lambda r: r["runtime"][key])          # noqa: E731
    dispatch = per("forward") / rt["ops"]
    extra = (per("train_recompute") - per("train")) / rt["recomputed_ops"]
    return RuntimeSpec(op_s=per("plain") / rt["plain_ops"], dispatch_s=dispatch,
                       backward_s=per("backward") / rt["ops"], optimizer_tensor_s=per("step") / rt["tensors"],
                       recompute_s=max(extra, dispatch))


def calibrated_profile(results, memory_bytes: float = None, name: str = "cpu") -> ClusterSpec:
    """The profile of a calibration run (the worker's per-rank results; several runs may be concatenated)."""
    ranks = int(results[0]["world"])
    dev = results[0]["device"]
    flops = dev["flop"] / pooled(results, lambda r: r["device"]["matmul"])
    bandwidth = dev["bytes"] / pooled(results, lambda r: r["device"]["copy"])
    fits = collective_fits(results)
    p2p = next(f for f in fits if f.collective == "send_recv")
    link = LinkSpec(latency_s=p2p.latency_s, bandwidth_Bps=min(p2p.bandwidth_Bps, UNBOUNDED_BANDWIDTH))
    facts = (("ranks_busy", ranks), ("matmul_n", dev["matmul_n"]), ("runs", len(runs(results))),
             ("omp_num_threads", os.environ.get("OMP_NUM_THREADS", "1")))
    return cpu_profile(flops, bandwidth * ranks, memory_bytes or host_memory_bytes(), ranks, name=name, link=link,
                       extra=facts, collectives=fits, runtime=runtime_costs(results))


def group_sizes(ranks: int) -> list:
    """2, 4, ... up to ``ranks``: the powers of two dividing it, and ``ranks`` itself."""
    sizes = [n for n in (2, 4, 8, 16, 32, 64) if n <= ranks and ranks % n == 0]
    return sorted(set(sizes + [ranks]))


def run_ranks(ranks: int, sizes, repeat: int, timeout: float = 300) -> list:
    """Launch the calibration worker on ``ranks`` real ranks; their results in rank order."""
    from autoparallel.testing.launch import launch

    config = {"sizes": list(sizes), "repeat": int(repeat), "groups": group_sizes(ranks)}
    return launch(WORKER, ranks, [json.dumps(config)], timeout=timeout)


def describe(profile: ClusterSpec) -> str:
    lines = [f"{'collective':<16}{'ranks':>6}{'latency us':>12}{'bandwidth MB/s':>16}"]
    for f in profile.collectives:
        bw = "unbounded" if f.bandwidth_Bps >= UNBOUNDED_BANDWIDTH else f"{f.bandwidth_Bps / 1e6:,.0f}"
        lines.append(f"{f.collective:<16}{f.group_size:>6}{f.latency_s * 1e6:>12.0f}{bw:>16}")
    rt = profile.runtime
    if rt is not None:
        lines.append(f"per op: plain {rt.op_s * 1e6:.1f} us, dispatched forward {rt.dispatch_s * 1e6:.1f} us, its "
                     f"backward {rt.backward_s * 1e6:.1f} us, recomputed {rt.recompute_op_s * 1e6:.1f} us, AdamW per "
                     f"tensor {rt.optimizer_tensor_s * 1e6:.1f} us")
    return "\n".join(lines)


# ---- command line -----------------------------------------------------------------------------------
def _parser():
    p = argparse.ArgumentParser(prog="autoparallel calibrate",
                                description="Measure this machine (gloo collectives on real ranks, per-op costs, "
                                            "matmul rate, bandwidth) into a CPU/gloo cluster profile JSON.")
    p.add_argument("--output", "-o", default="cluster_profile.json", help="profile path (default cluster_profile.json)")
    p.add_argument("--ranks", type=int, default=4, help="CPU ranks the profile describes and launches (default 4)")
    p.add_argument("--quick", action="store_true", help=f"three message sizes {QUICK_SIZES} and 4 repeats")
    p.add_argument("--repeat", type=int, default=None, help="repetitions per measurement (default 12, quick 4)")
    p.add_argument("--no-launch", dest="no_launch", action="store_true",
                   help="measure in this process only: no collectives (assumed loopback link), per-op costs alone")
    p.add_argument("--matmul-size", type=int, default=1024, help="n of the in-process matmul (--no-launch)")
    p.add_argument("--no-paddle", action="store_true", help="measure the in-process matmul with numpy (--no-launch)")
    return p


def _in_process(args) -> ClusterSpec:
    flops, engine = measure_matmul_flops(args.matmul_size, args.repeat, use_paddle=not args.no_paddle)
    bandwidth = measure_memory_bandwidth(repeat=args.repeat)
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    if threads != "1":
        print("autoparallel calibrate: warning: OMP_NUM_THREADS is not 1, so the matmul rate is that of several "
              "threads while each rank runs one; set OMP_NUM_THREADS=1 as the ranks do", file=sys.stderr)
    print(f"matmul ({engine}, n={args.matmul_size}, OMP_NUM_THREADS={threads}): {flops / 1e9:.1f} GFLOP/s per rank")
    print(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s (copy)")
    return cpu_profile(flops, bandwidth, host_memory_bytes(), args.ranks,
                       extra=(("matmul_engine", engine), ("matmul_n", args.matmul_size), ("omp_num_threads", threads)))


def main(argv=None) -> int:
    p = _parser()
    try:
        args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    args.repeat = args.repeat if args.repeat is not None else (4 if args.quick else 12)
    if args.ranks <= 0 or args.matmul_size <= 0 or args.repeat <= 0:
        print(f"autoparallel calibrate: error: --ranks, --matmul-size and --repeat must be positive, got "
              f"{args.ranks}, {args.matmul_size}, {args.repeat}", file=sys.stderr)
        return 2
    try:
        output_path("--output", args.output, ("json",))       # before minutes of measuring, not after
        bounded("--ranks", args.ranks, 1024, "ranks on one machine")
        bounded("--matmul-size", args.matmul_size, 2 ** 15, "rows of a square matmul (4 GiB in float32)")
        bounded("--repeat", args.repeat, 10 ** 4, "repetitions")
    except ValueError as exc:
        print(f"autoparallel calibrate: error: {exc}", file=sys.stderr)
        return 2
    if not args.no_launch and args.ranks < 2:
        print(f"autoparallel calibrate: error: measuring collectives needs --ranks >= 2, got {args.ranks} "
              f"(or pass --no-launch)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    if args.no_launch:
        profile = _in_process(args)
        note = "collective timings: assumed, not measured (--no-launch)"
    else:
        results = run_ranks(args.ranks, QUICK_SIZES if args.quick else SIZES, args.repeat)
        profile = calibrated_profile(results)
        flops, bw = profile.device.flops("float32"), profile.device.memory_bandwidth_Bps
        print(f"{args.ranks} ranks busy at once: matmul {flops / 1e9:.1f} GFLOP/s and copy {bw / 1e9:.1f} GB/s per rank")
        print(describe(profile))
        note = "collectives measured on real gloo ranks"
    profile.to_json(args.output)
    print(f"profile for {args.ranks} gloo ranks written to {args.output} ({note}; {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
