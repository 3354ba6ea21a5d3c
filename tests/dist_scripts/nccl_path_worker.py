"""Runs on every rank (2) of a gloo job: the runtime's NCCL branches (native reduce_scatter / alltoall, ReduceOp.AVG,
float16 / bfloat16 reductions without an fp32 upcast, sync_op=False gradient buckets), taken through
``autoparallel.testing.nccl_doubles.as_nccl``. One launch, several checks:

* ``doubles``: each double against paddle's documented semantics, from every rank's known inputs;
* ``reshards``: reshards with a backend branch, under gloo and under "nccl" (values, gradients, the calls made);
* ``training``: DP, ZeRO-1/2/3 (``shard_optimizer`` and ``parallelize``), TP + SP under "nccl"; rank 0 saves
  each run's losses and final parameters to OUT_DIR/<name>.npz (compared with one process by the test).

    nccl_path_worker.py OUT_DIR            (2 ranks)
    nccl_path_worker.py OUT_DIR four       (4 ranks: reshard_worker's cases, DP2 x TP2 + SP (+ ZeRO-2) under "nccl")
"""
import contextlib
import os
import sys
from unittest import mock

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

import autoparallel as ap
from autoparallel import layer_state
from autoparallel.comm.counter import count_collectives, count_comm
from autoparallel.comm.transport import RealTransport
from autoparallel.placement import parse_placements
from autoparallel.testing.check import expected_local
from autoparallel.testing.launch import write_result
from autoparallel.testing.models import adamw, batch, build, train_steps
from autoparallel.testing.nccl_doubles import as_nccl, gloo_doubles
from reshard_worker import CASES, run_case

STEPS = 3
WORLD = 2


def _inputs(rank, shape, dtype="float32", seed=0):
    return np.random.default_rng(seed * 10 + rank).standard_normal(shape).astype(dtype)


def _close(a, b, tol=1e-6):
    a, b = np.asarray(a, dtype="float64"), np.asarray(b, dtype="float64")
    return bool(a.shape == b.shape and np.allclose(a, b, rtol=tol, atol=tol))


def doubles(rank):
    """Each double's result against the documented semantics, computed in numpy from both ranks' inputs."""
    out = {}
    with gloo_doubles() as calls:
        xs = [_inputs(r, [4, 3]) for r in range(WORLD)]
        t = paddle.empty([2, 3], dtype="float32")
        dist.reduce_scatter(t, [paddle.to_tensor(xs[rank][:2]), paddle.to_tensor(xs[rank][2:])])
        out["reduce_scatter_sum"] = _close(t.numpy(), sum(xs)[2 * rank:2 * rank + 2])
        dist.reduce_scatter(t, list(paddle.split(paddle.to_tensor(xs[rank]), 2)), op=dist.ReduceOp.MAX)
        out["reduce_scatter_max"] = _close(t.numpy(), np.maximum(*xs)[2 * rank:2 * rank + 2])
        dist.reduce_scatter(t, list(paddle.split(paddle.to_tensor(xs[rank]), 2)), op=dist.ReduceOp.AVG)
        out["reduce_scatter_avg"] = _close(t.numpy(), (sum(xs) / 2)[2 * rank:2 * rank + 2])
        h = [x.astype("float16") for x in xs]
        t16 = paddle.empty([2, 3], dtype="float16")
        dist.reduce_scatter(t16, list(paddle.split(paddle.to_tensor(h[rank]), 2)))
        want16 = (h[0].astype("float32") + h[1].astype("float32")).astype("float16")
        out["reduce_scatter_fp16"] = bool(np.array_equal(t16.numpy(), want16[2 * rank:2 * rank + 2]))
        got = []
        dist.alltoall(got, list(paddle.split(paddle.to_tensor(xs[rank]), 2)))
        out["alltoall"] = _close(np.concatenate([g.numpy() for g in got]),
                                 np.concatenate([xs[q][2 * rank:2 * rank + 2] for q in range(WORLD)]))
        sizes_in = [[1, 3], [2, 2]]                 # rank q sends sizes_in[q][j] rows to rank j
        o = paddle.empty([sizes_in[0][rank] + sizes_in[1][rank], 3], dtype="float32")
        dist.alltoall_single(o, paddle.to_tensor(xs[rank]), sizes_in[rank], [sizes_in[q][rank] for q in range(2)])
        want = [xs[q][sum(sizes_in[q][:rank]):sum(sizes_in[q][:rank + 1])] for q in range(WORLD)]
        out["alltoall_single_uneven"] = _close(o.numpy(), np.concatenate(want))
        a = paddle.to_tensor(xs[rank])
        dist.all_reduce(a, op=dist.ReduceOp.AVG)
        out["all_reduce_avg"] = _close(a.numpy(), sum(xs) / 2)
        ints = [np.array([3, -5, 7], dtype="int64") * (r + 1) for r in range(WORLD)]
        a = paddle.to_tensor(ints[rank])
        dist.all_reduce(a, op=dist.ReduceOp.AVG)
        out["all_reduce_avg_int"] = bool(np.array_equal(a.numpy(), np.trunc(sum(ints) / 2).astype("int64")))
        a = paddle.to_tensor(h[rank])
        dist.all_reduce(a)
        out["all_reduce_fp16"] = bool(np.array_equal(a.numpy(), want16))
        b = [paddle.to_tensor(x).astype("bfloat16") for x in xs]
        a = b[rank].clone()
        task = dist.all_reduce(a, sync_op=False)
        task.wait()
        want_bf = (b[0].astype("float32") + b[1].astype("float32")).astype("bfloat16").astype("float32")
        out["all_reduce_bf16_async"] = bool(np.array_equal(a.astype("float32").numpy(), want_bf.numpy()))
        a = paddle.to_tensor(xs[rank])
        task = dist.all_reduce(a, sync_op=False)
        out["async_not_done_before_wait"] = _close(a.numpy(), xs[rank]) and not task.is_completed()
        task.wait()
        out["all_reduce_fp32_async"] = _close(a.numpy(), sum(xs)) and task.is_completed()
    out["calls"] = dict(calls)
    return out


# ---- reshards -------------------------------------------------------------------------------------------------
SHARED = [((7, 4), [0, 1], "P(sum)", "S(0)"), ((6, 4), [0, 1], "P(sum)", "S(1)"), ((6, 4), [0, 1], "P(avg)", "S(1)"),
          ((6, 8), [0, 1], "S(0)", "S(1)"), ((7, 5), [0, 1], "S(1)", "S(0)"), ((6, 4), [0, 1], "P(avg)", "R"),
          ((6, 4), [1, 0], "P(sum)", "S(1)"), ((6, 8), [1, 0], "S(0)", "S(1)")]    # mesh order != group order
SUMS = [((6, 4), "float32", "P(sum)", "S(0)"), ((5, 6), "float32", "P(sum)", "S(1)"),
        ((6, 4), "float32", "P(avg)", "R"), ((6, 4), "float32", "P(avg)", "S(0)"),
        ((6, 4), "float16", "P(sum)", "R"), ((6, 4), "float16", "P(sum)", "S(0)"),
        ((4, 6), "bfloat16", "P(avg)", "S(1)")]


def partial_sum_case(shape, dtype, src, dst, rank):
    """Each rank's own term of a Partial tensor (a true sum over ranks, not one rank's value and zeros)."""
    mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
    terms = [_inputs(r, shape, seed=sum(shape)) for r in range(WORLD)]
    local = paddle.to_tensor(terms[rank]).astype(dtype)
    x = ap.dtensor_from_local(local, mesh, parse_placements(src))
    with count_comm() as log:
        y = ap.reshard(x, mesh, parse_placements(dst))
    low = [paddle.to_tensor(t).astype(dtype).astype("float32").numpy() for t in terms]
    full = (low[0] + low[1]) / (2 if "avg" in src else 1)
    if dtype != "float32":
        full = paddle.to_tensor(full).astype(dtype).astype("float32").numpy()
    got = y.local.astype("float32").numpy()
    return {"case": f"{list(shape)} {dtype} {src} -> {dst}", "value": got.tolist(),
            "ok": _close(got, expected_local(full, y.spec, mesh.coords_of(rank)), 1e-6 if dtype == "float32" else 0),
            "calls": {k: v[0] for k, v in log.summary().items()}}


def reshards(rank):
    """Every case under gloo, then under "nccl": {backend: [case result + "native": the doubles' call counts]};
    "negative": the NCCL branches with the group's members taken in the wrong order must fail the value check."""
    out = {"gloo": [], "nccl": []}
    for backend in ("gloo", "nccl"):
        for shape, ranks, src, dst in SHARED:
            with contextlib.ExitStack() as stack:
                native = stack.enter_context(as_nccl()) if backend == "nccl" else {}
                c = run_case(shape, ranks, src, dst, rank)
            out[backend].append({"case": c["case"], "ok": c["ok"], "grad_ok": c["grad_ok"], "native": dict(native),
                                 "calls": {k: v[0] for k, v in c["calls"].items()}})
        for case in SUMS:
            with contextlib.ExitStack() as stack:
                native = stack.enter_context(as_nccl()) if backend == "nccl" else {}
                out[backend].append({**partial_sum_case(*case, rank), "native": dict(native)})
    flipped = lambda self, ranks: sorted(ranks, reverse=True)         # noqa: E731
    with as_nccl(), mock.patch.object(RealTransport, "_rank_order", flipped):
        out["negative"] = {"P(sum) -> S(0)": partial_sum_case((6, 4), "float32", "P(sum)", "S(0)", rank)["ok"],
                           "S(0) -> S(1)": run_case((6, 8), [0, 1], "S(0)", "S(1)", rank)["ok"]}
    return out


# ---- training -------------------------------------------------------------------------------------------------
def _strategy(tp=1, sp=False, stage=None, world=WORLD):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = world // tp, tp
    s.sequence_parallel.enable = sp
    if stage:
        s.sharding.enable, s.sharding.stage = True, stage
    return s


def _build(kind):
    m = build("gpt")
    if kind.startswith("shard_optimizer_zero"):
        stage = int(kind[-1])
        m, _ = ap.parallelize(m, None, strategy=_strategy())
        cls = {1: ap.ShardingStage1, 2: ap.ShardingStage2, 3: ap.ShardingStage3}[stage]
        return m, ap.shard_optimizer(adamw(m.parameters()), cls("data", layer_state.mesh_of(m)))
    if kind in LOOPS:
        return ap.parallelize(m, make_opt(kind, m.parameters()), strategy=_strategy())
    s = {"dp2": _strategy(), "tp2_sp": _strategy(tp=2, sp=True), "dp2_tp2_sp": _strategy(2, True, world=4),
         "dp2_tp2_sp_zero2": _strategy(2, True, 2, world=4)}.get(kind) or _strategy(stage=int(kind[-1]))
    return ap.parallelize(m, adamw(m.parameters()), strategy=s)


RUNS = ["dp2", "tp2_sp", "parallelize_zero1", "parallelize_zero2", "parallelize_zero3",
        "shard_optimizer_zero1", "shard_optimizer_zero2", "shard_optimizer_zero3"]
# data parallel with the buckets launched asynchronously, read by other code of the step: the loop's own
LOOPS = ["dp2_clip", "dp2_accum", "dp2_hand_clip"]


def make_opt(name, params):
    """The optimizer of run ``name`` (one process uses the same)."""
    clip = paddle.nn.ClipGradByGlobalNorm(0.05) if name == "dp2_clip" else None
    return adamw(params, grad_clip=clip) if clip else adamw(params)


def loop(name, model, opt):
    """The training loop of run ``name`` (one process runs the same): the losses. ``dp2_accum``: two micro-batches
    a step; ``dp2_hand_clip``: ``paddle.nn.utils.clip_grad_norm_`` between backward and the step."""
    k, losses = (2 if name == "dp2_accum" else 1), []
    for i in range(STEPS):
        total = 0.0
        for j in range(k):
            ids, lab = batch(i * k + j)
            loss = F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()
            (loss / k).backward()
            total += float(loss) / k
        if name == "dp2_hand_clip":
            paddle.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.clear_grad()
        losses.append(total)
    return losses


def training(rank, out_dir, runs=RUNS + LOOPS):
    out = {}
    for name in runs:
        with as_nccl() as calls, count_comm() as log, count_collectives() as logical:
            m, opt = _build(name)
            losses = loop(name, m, opt) if name in LOOPS else train_steps(m, opt, STEPS)
            params = {n: p.full().numpy() for n, p in m.named_parameters()}
        if rank == 0:
            np.savez(os.path.join(out_dir, name + ".npz"), losses=np.array(losses),
                     **{"param/" + n: v for n, v in params.items()})
        out[name] = {"losses": losses, "calls": dict(calls), "logical": logical.counts(rank),
                     "logged": {k: v[0] for k, v in log.summary().items()}}
    if "dp2" not in runs:
        return out
    with count_collectives() as logical:            # the same data-parallel run on gloo: the logical collectives
        m, opt = _build("dp2")
        out["dp2_gloo"] = {"losses": train_steps(m, opt, STEPS), "logical": logical.counts(rank)}
    return out


def four_ranks(rank):
    """reshard_worker's cases (2-D meshes, meshes in another order than the groups, uneven shards) under "nccl"."""
    out = []
    for shape, ranks, src, dst in CASES:
        with as_nccl() as native:
            c = run_case(shape, ranks, src, dst, rank)
        out.append({"case": c["case"], "ok": c["ok"], "grad_ok": c["grad_ok"], "native": dict(native),
                    "calls": {k: v[0] for k, v in c["calls"].items()}})
    return out


def main():
    out_dir = sys.argv[1]
    dist.init_parallel_env()
    rank = dist.get_rank()
    if sys.argv[2:] == ["four"]:
        write_result({"rank": rank, "reshards": four_ranks(rank),
                      "training": training(rank, out_dir, ["dp2_tp2_sp", "dp2_tp2_sp_zero2"])})
        return
    write_result({"rank": rank, "doubles": doubles(rank), "reshards": reshards(rank),
                  "training": training(rank, out_dir)})


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
