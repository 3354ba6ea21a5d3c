"""The python cost around a collective, in one process (no peers: paddle.distributed is stubbed by no-ops).

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench comm-overhead [--shape 4 128 256]

Prints microseconds per call (the fastest of 7 rounds of 200 calls, so background load inflates little):
the comm/counter.py wrapper around a no-op all_reduce, the real transport's all_reduce around a no-op, the
clone inside it, and the size computations (``int(t.numel())`` vs the product of the shape).
"""
from __future__ import annotations

import argparse
import math
import time
import types


import paddle
import paddle.distributed as dist

from autoparallel.comm import transport
from autoparallel.comm.counter import count_comm
from autoparallel.comm.sizes import nbytes


def best_us(fn, n: int = 200, rounds: int = 7) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e6


class _Group:
    ranks, nranks = [0, 1], 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs="+", default=[4, 128, 256])
    return p


def measure(shape) -> dict:
    """Microseconds per call of each piece, on a float32 tensor of ``shape``."""
    x = paddle.randn(shape)
    noop = types.SimpleNamespace(all_reduce=lambda t, op=None, group=None, sync_op=True: None,
                                 ReduceOp=dist.ReduceOp)
    tr = transport.RealTransport(0, "gloo")
    tr._dist = lambda: noop
    tr._group = lambda ranks: _Group()
    rows = {"transport all_reduce around a no-op": best_us(lambda: tr.all_reduce({0: x}, [0, 1], "sum")),
            "  of which x.clone()": best_us(lambda: x.clone()),
            "int(t.numel()) * t.element_size()": best_us(lambda: int(x.numel()) * x.element_size()),
            "t.numel() == 0 as a condition": best_us(lambda: bool(x.numel() == 0)),
            "comm.sizes.nbytes(t) (shape product)": best_us(lambda: nbytes(x))}
    saved = dist.all_reduce, dist.get_world_size, dist.get_rank
    dist.all_reduce, dist.get_world_size, dist.get_rank = noop.all_reduce, (lambda: 2), (lambda: 0)
    try:
        with count_comm():
            wrapped = dist.all_reduce
            rows["count_comm wrapper around a no-op all_reduce"] = best_us(lambda: wrapped(x, group=_Group()))
    finally:
        dist.all_reduce, dist.get_world_size, dist.get_rank = saved
    return rows


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    rows = measure(args.shape)
    print(f"tensor {args.shape} float32 ({math.prod(args.shape) * 4 / 1e3:.0f} kB); us per call, best of 7x200")
    for name, us in rows.items():
        print(f"{name:<48} {us:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
