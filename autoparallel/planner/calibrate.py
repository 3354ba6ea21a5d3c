"""``autoparallel calibrate``: measure this machine into a CPU/gloo cluster profile (JSON).

Measured in-process: dense matmul FLOP/s (paddle if importable, else numpy; float32, the CPU's training
dtype) and memory bandwidth (a large array copy). The profile is a ClusterSpec with backend "gloo" and
overlap 0 (gloo's sync_op=False blocks, so no communication hides behind compute), one node of
``--ranks`` devices that share the machine's memory, and precision fp32.

Collective latency and bandwidth over gloo are NOT measured yet: the profile carries placeholder
loopback figures and says so in ``extra`` ("collectives", "assumed"). Measuring them needs a multi-rank
launch (paddle.distributed.launch) and belongs with the runtime.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from autoparallel.planner.cluster import ClusterSpec, DeviceSpec, LinkSpec

# placeholders for gloo over loopback TCP until collectives are measured
ASSUMED_GLOO_LINK = LinkSpec(latency_s=5e-5, bandwidth_Bps=1e9)


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


def cpu_profile(flops: float, memory_bandwidth_Bps: float, memory_bytes: float, ranks: int,
                name: str = "cpu", link: LinkSpec = ASSUMED_GLOO_LINK, extra=()) -> ClusterSpec:
    """A one-node gloo ClusterSpec of ``ranks`` CPU 'devices' sharing the machine's memory and bandwidth."""
    if ranks <= 0:
        raise ValueError(f"ranks must be a positive integer, got {ranks}")
    device = DeviceSpec(f"{name}-rank", (("float32", flops), ("bfloat16", flops), ("float16", flops)),
                        memory_bytes / ranks, memory_bandwidth_Bps / ranks)
    # the measured matmul rate is already a sustained rate: no further GEMM efficiency factor
    facts = (("precision", "fp32"), ("gemm_efficiency", 1.0), ("collectives", "assumed")) + tuple(extra)
    return ClusterSpec(f"1x{ranks}:{name}", 1, ranks, device, link, link, backend="gloo", overlap=0.0, extra=facts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="autoparallel calibrate",
                                description="Measure this machine into a CPU/gloo cluster profile JSON.")
    p.add_argument("--output", "-o", default="cluster_profile.json", help="profile path (default cluster_profile.json)")
    p.add_argument("--ranks", type=int, default=4, help="CPU ranks the profile describes (default 4)")
    p.add_argument("--matmul-size", type=int, default=1024, help="n of the n x n x n matmul (default 1024)")
    p.add_argument("--repeat", type=int, default=5, help="repetitions, best taken (default 5)")
    p.add_argument("--no-paddle", action="store_true", help="measure the matmul with numpy")
    try:
        args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.ranks <= 0 or args.matmul_size <= 0 or args.repeat <= 0:
        print(f"autoparallel calibrate: error: --ranks, --matmul-size and --repeat must be positive, got "
              f"{args.ranks}, {args.matmul_size}, {args.repeat}", file=sys.stderr)
        return 2
    flops, engine = measure_matmul_flops(args.matmul_size, args.repeat, use_paddle=not args.no_paddle)
    bandwidth = measure_memory_bandwidth(repeat=args.repeat)
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    if threads != "1":
        print("autoparallel calibrate: warning: OMP_NUM_THREADS is not 1, so the matmul rate is that of several "
              "threads while each rank runs one; set OMP_NUM_THREADS=1 as the ranks do", file=sys.stderr)
    # each rank runs one thread (OMP_NUM_THREADS=1): the measured matmul rate is per rank; the ranks share
    # the memory bus, so cpu_profile splits the bandwidth between them
    profile = cpu_profile(flops, bandwidth, host_memory_bytes(), args.ranks, extra=(("matmul_engine", engine), ("matmul_n", args.matmul_size),
                                             ("omp_num_threads", threads)))
    profile.to_json(args.output)
    print(f"matmul ({engine}, n={args.matmul_size}, OMP_NUM_THREADS={threads}): {flops / 1e9:.1f} GFLOP/s per rank")
    print(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s (copy)")
    print(f"profile for {args.ranks} gloo ranks written to {args.output} (collective timings: assumed, not measured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
