"""Runs on every rank of the reshard benchmark (launched by tools/bench/resharding.py).

For each (transition, size): ours (``ap.reshard``) and Paddle's own (``paddle.distributed.reshard``) from
the same full tensor; warm-up, then timed repeats with a barrier before each; the per-repeat maximum over
ranks is kept. Results are checked against the full tensor, and the bytes this rank sent by ours are counted
by wrapping ``paddle.distributed`` (comm/counter.py). Each rank writes its rows with ``write_result``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import paddle
import paddle.distributed as dist

import autoparallel as ap
from autoparallel.comm.counter import count_comm
from autoparallel.comm.world import planning_cluster
from autoparallel.placement import Partial, Replicate, Shard, parse_placements
from autoparallel.spec import DistSpec
from autoparallel.testing.check import expected_local
from autoparallel.testing.launch import write_result
from reshard import plan_reshard

MESHES = {"4": [0, 1, 2, 3], "2x2": [[0, 1], [2, 3]]}

# (mesh, src, dst): every single-dim kind of transition on a 1-d mesh of 4, and multi-dim paths on 2x2
CASES = [
    ("4", "R", "S(0)"),
    ("4", "S(0)", "R"),
    ("4", "S(1)", "R"),
    ("4", "P(sum)", "R"),
    ("4", "P(sum)", "S(0)"),
    ("4", "S(0)", "S(1)"),
    ("4", "R", "P(sum)"),
    ("2x2", "S(0),R", "R,S(1)"),
    ("2x2", "S(0),S(1)", "R,R"),
    ("2x2", "R,R", "S(0),S(1)"),
    ("2x2", "P(sum),S(1)", "R,S(1)"),
    ("2x2", "S(0),S(1)", "S(1),S(0)"),
]

RTOL, ATOL = 1e-5, 1e-5


def full_tensor(size: int) -> np.ndarray:
    return np.random.default_rng(size).standard_normal((size, size)).astype("float32")


def to_paddle_placements(placements) -> list:
    out = []
    for p in placements:
        if isinstance(p, Shard):
            out.append(dist.Shard(p.dim))
        elif isinstance(p, Replicate):
            out.append(dist.Replicate())
        elif isinstance(p, Partial) and p.reduce_type == "sum":
            out.append(dist.Partial(dist.ReduceType.kRedSum))
        else:
            raise ValueError(f"expected Shard, Replicate or Partial(sum), got {p}")
    return out


def timed(fn, warmup: int, repeats: int) -> float:
    """Median over repeats of the slowest rank's time (barrier before each repeat)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    t = paddle.to_tensor(np.asarray(times, dtype="float32"))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(statistics.median(t.numpy().tolist()))


def matches(local: np.ndarray, x: np.ndarray, spec: DistSpec, rank: int) -> bool:
    want = expected_local(x, spec, spec.mesh.coords_of(rank))
    return local.shape == want.shape and bool(np.allclose(local, want, rtol=RTOL, atol=ATOL))


def check(local_of, replicate_of, x, spec, rank) -> bool:
    """Non-Partial destinations: this rank's shard equals its slice of ``x``; Partial ones: the reduced
    value (resharded to replicate by the same library) equals ``x``."""
    if spec.partial_mesh_dims():
        return bool(np.allclose(replicate_of(), x, rtol=RTOL, atol=ATOL))
    return matches(local_of(), x, spec, rank)


def all_ranks(flag: bool) -> bool:
    t = paddle.to_tensor([1 if flag else 0], dtype="int32")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.numpy()[0])


def run_ours(x, mesh, src, dst, rank, warmup, repeats) -> dict:
    spec = DistSpec(mesh, dst, x.shape, "float32")
    dt = ap.shard_tensor(paddle.to_tensor(x), mesh, src)
    y = ap.reshard(dt, mesh, dst)
    ok = check(lambda: y.local.numpy(), lambda: ap.reshard(y, mesh, [Replicate()] * mesh.ndim).local.numpy(),
               x, spec, rank)
    with count_comm() as log:
        ap.reshard(dt, mesh, dst)
    plan = plan_reshard(x.shape, "float32", mesh, src, dst, cluster=planning_cluster())
    seconds = timed(lambda: ap.reshard(dt, mesh, dst), warmup, repeats)
    return {"ok": all_ranks(ok), "seconds": seconds, "bytes_sent": log.bytes_sent,
            "calls": {k: v[0] for k, v in log.summary().items()}, "plan_bytes": plan.bytes_per_rank,
            "plan": [s.collective + (f" [{s.emulated}]" if s.emulated else "") for s in plan.steps]}


def run_paddle(x, mesh, pmesh, src, dst, rank, warmup, repeats) -> dict:
    spec = DistSpec(mesh, dst, x.shape, "float32")
    psrc, pdst = to_paddle_placements(src), to_paddle_placements(dst)
    a = dist.shard_tensor(paddle.to_tensor(x), pmesh, psrc)
    try:
        b = dist.reshard(a, pmesh, pdst)
    except NotImplementedError as e:   # raised by the kernel lookup on every rank, before communicating
        msg = str(e).strip().splitlines()[0]
        return {"unsupported": msg}
    rep = [dist.Replicate()] * mesh.ndim
    ok = check(lambda: b._local_value().numpy(), lambda: dist.reshard(b, pmesh, rep)._local_value().numpy(),
               x, spec, rank)
    seconds = timed(lambda: dist.reshard(a, pmesh, pdst), warmup, repeats)
    return {"ok": all_ranks(ok), "seconds": seconds}


def main() -> None:
    ap_ = argparse.ArgumentParser()
    ap_.add_argument("--sizes", default="256,1024,2048")
    ap_.add_argument("--warmup", type=int, default=2)
    ap_.add_argument("--repeats", type=int, default=7)
    args = ap_.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    dist.init_parallel_env()
    rank = dist.get_rank()
    if dist.get_world_size() != 4:
        raise SystemExit(f"the reshard benchmark expects 4 ranks, got {dist.get_world_size()}")
    meshes = {k: ap.ProcessMesh(v, dim_names=["x", "y"][:np.ndim(v)]) for k, v in MESHES.items()}
    pmeshes = {k: dist.ProcessMesh(v, dim_names=["x", "y"][:np.ndim(v)]) for k, v in MESHES.items()}
    progress = os.environ.get("AP_BENCH_PROGRESS") if rank == 0 else None
    if progress:
        open(progress, "w").close()
    rows = []
    for size in sizes:
        x = full_tensor(size)
        for mesh_key, src_s, dst_s in CASES:
            mesh, pmesh = meshes[mesh_key], pmeshes[mesh_key]
            src, dst = parse_placements(src_s), parse_placements(dst_s)
            row = {"mesh": mesh_key, "src": src_s, "dst": dst_s, "size": size,
                   "ours": run_ours(x, mesh, src, dst, rank, args.warmup, args.repeats),
                   "paddle": run_paddle(x, mesh, pmesh, src, dst, rank, args.warmup, args.repeats)}
            rows.append(row)
            if progress:
                with open(progress, "a") as f:
                    f.write(f"mesh {mesh_key} {src_s} -> {dst_s} {size}x{size}\n")
    write_result(rows)


if __name__ == "__main__":
    main()
