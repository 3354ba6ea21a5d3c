"""Runs on every rank of a real gloo job: a representative set of reshards checked against the full
tensor on every rank, gradients through reshard, and a negative control."""
import numpy as np
import paddle
import paddle.distributed as dist

import autoparallel as ap
from autoparallel.comm.counter import count_comm
from autoparallel.placement import parse_placements
from autoparallel.testing.check import expected_local
from autoparallel.testing.launch import write_result

CASES = [
    # (shape, mesh, src, dst)
    ((8, 6), [0, 1, 2, 3], "S(0)", "R"),
    ((7, 5), [0, 1, 2, 3], "S(0)", "R"),
    ((5, 3), [0, 1, 2, 3], "R", "S(0)"),
    ((6, 8), [0, 1, 2, 3], "S(0)", "S(1)"),
    ((7, 5), [0, 1, 2, 3], "S(1)", "S(0)"),
    ((6, 4), [0, 1, 2, 3], "P(sum)", "R"),
    ((7, 4), [0, 1, 2, 3], "P(sum)", "S(0)"),
    ((6, 4), [0, 1, 2, 3], "P(max)", "R"),
    ((6, 4), [0, 1, 2, 3], "P(avg)", "S(1)"),
    ((6, 4), [0, 1, 2, 3], "R", "P(sum)"),
    ((8, 8), [[0, 1], [2, 3]], "S(0),R", "R,S(1)"),
    ((5, 7), [[0, 1], [2, 3]], "S(0),S(1)", "R,R"),
    ((6, 6), [[0, 1], [2, 3]], "P(sum),S(0)", "S(1),R"),
    ((7, 6), [[0, 1], [2, 3]], "S(0),S(0)", "S(1),R"),
    ((4, 6), [[3, 1], [2, 0]], "S(1),S(0)", "R,R"),
    ((6, 6), [[3, 1], [2, 0]], "R,P(sum)", "S(0),S(1)"),
    # block-sharded (fused projections): all_gather + reorder, local slice, via R, reduce then slice
    ((4, 12), [[0, 1], [2, 3]], "S(0),S(1,blocks=(8,4))", "R,R"),
    ((4, 12), [[0, 1], [2, 3]], "R,R", "S(1,blocks=(4,4,4)),S(0)"),
    ((6, 8), [0, 1, 2, 3], "S(1,blocks=(4,4))", "S(0)"),
    ((4, 8), [0, 1, 2, 3], "P(sum)", "S(1,blocks=(4,4))"),
]


def run_case(shape, ranks, src, dst, rank):
    mesh = ap.ProcessMesh(ranks, dim_names=[f"m{i}" for i in range(np.ndim(ranks))])
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype("float32")
    w = rng.standard_normal(shape).astype("float32")
    src_p, dst_p = parse_placements(src), parse_placements(dst)
    dt = ap.shard_tensor(paddle.to_tensor(x), mesh, src_p)
    with count_comm() as log:
        y = ap.reshard(dt, mesh, dst_p)
    coords = mesh.coords_of(rank)
    has_partial = any(p.is_partial() for p in dst_p)
    if has_partial:
        value = ap.reshard(y, mesh, [ap.Replicate()] * mesh.ndim).local.numpy()
        ok = bool(np.allclose(value, x, rtol=1e-5, atol=1e-6))
        neg = None
    else:
        got = y.local.numpy()
        ok = bool(np.allclose(got, expected_local(x, y.spec, coords), rtol=1e-5, atol=1e-6))
        wrong = expected_local(x, y.spec, coords, flip=True)
        neg = bool(got.shape == wrong.shape and np.allclose(got, wrong, rtol=1e-5, atol=1e-6))
    # gradient through reshard: loss = sum(full(y) * w); d loss / d x = w
    dt2 = ap.shard_tensor(paddle.to_tensor(x), mesh, src_p, stop_gradient=False)
    y2 = ap.reshard(dt2, mesh, dst_p)
    loss = (y2.full() * paddle.to_tensor(w)).sum()
    loss.backward()
    g = dt2.local.grad.numpy()
    grad_spec = dt2.spec.with_placements([ap.Replicate() if p.is_partial() else p for p in src_p])
    # per-term convention for Partial sources: P(sum) terms get the true gradient; P(avg) terms 1/n;
    # P(max)/P(min) split it between tied terms (shard_tensor puts the same value on every rank)
    scale = 1.0
    for i, p in enumerate(src_p):
        if p.is_partial() and p.reduce_type != "sum":
            scale /= mesh.shape[i]
    grad_ok = bool(np.allclose(g, expected_local(w, grad_spec, coords) * scale, rtol=1e-5, atol=1e-5))
    return {"case": f"{list(shape)} mesh {ranks} {src} -> {dst}", "ok": ok, "grad_ok": grad_ok,
            "negative_passed": neg, "bytes_sent": log.bytes_sent, "calls": log.summary()}


def main():
    dist.init_parallel_env()
    rank = dist.get_rank()
    out = []
    for case in CASES:          # a failed collective poisons the job: let it fail (launch reports the logs)
        out.append(run_case(*case, rank))
    write_result(out)


if __name__ == "__main__":
    main()
