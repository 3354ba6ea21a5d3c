"""Reshard demo: every rank builds a 2 x (N/2) mesh, and for a handful of transitions rank 0 prints the
plan, every rank executes it on real data, checks its shard against the full tensor, and all ranks agree
on the verdict through an all_reduce of a flag.

    autoparallel demo --nproc 4                       # or: make demo
    python -m paddle.distributed.launch --nproc_per_node 4 examples/reshard_demo.py
    python examples/reshard_demo.py --simulate 4      # one process, no launcher

The per-rank logic (``run_demo``) also runs in the simulated world (``with ap.simulate(world_size=4):``,
``--simulate N``), where this process holds every rank's shard and checks all of them.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import paddle

import autoparallel as ap
from autoparallel.comm.counter import count_comm
from autoparallel.comm.world import current_world, planning_cluster
from autoparallel.placement import format_placements, parse_placements
from autoparallel.spec import DistSpec
from autoparallel.testing.check import expected_local
from reshard import plan_reshard
from reshard.units import fmt_bytes, fmt_seconds

# (what it shows, shape, src, dst) on a mesh with dims ("data", "model")
TRANSITIONS = [
    ("replicate -> shard: a free local slice", (1024, 768), "R,R", "S(0),R"),
    ("move the sharded dim: slice first, gather later", (1024, 768), "S(0),R", "R,S(1)"),
    ("gather a 2-d shard back to every rank", (1024, 768), "S(0),S(1)", "R,R"),
    ("reduce partial sums (e.g. gradients)", (1024, 768), "P(sum),R", "R,R"),
    ("reduce partial sums and keep a shard", (1024, 768), "P(sum),S(1)", "S(0),S(1)"),
    ("swap the sharded dim (all_to_all)", (1024, 768), "S(0),R", "S(1),R"),
    ("uneven shards (ceil-division, 7 rows over 2)", (7, 5), "S(0),S(1)", "S(1),S(0)"),
]
RTOL, ATOL = 1e-5, 1e-5


def demo_mesh(world_size: int) -> ap.ProcessMesh:
    if world_size < 2 or world_size % 2:
        raise ValueError(f"the reshard demo needs an even number of ranks >= 2 for a 2 x N/2 mesh, got {world_size}")
    return ap.ProcessMesh(np.arange(world_size).reshape(2, world_size // 2).tolist(), dim_names=["data", "model"])


def full_tensor(shape, seed) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def make_source(x: np.ndarray, mesh, placements, seed: int):
    """A DistTensor of ``x`` in ``placements``. Partial(sum) mesh dims hold genuinely different terms that
    sum to ``x`` (as gradients before their reduction do), not the value and zeros."""
    spec = DistSpec(mesh, placements, x.shape, "float32")
    pdims = spec.partial_mesh_dims()
    if any(placements[i].reduce_type != "sum" for i in pdims):
        raise ValueError(f"the demo builds Partial(sum) sources only, got {format_placements(placements)}")
    n_terms = int(np.prod([mesh.shape[i] for i in pdims])) if pdims else 1
    rng = np.random.default_rng(seed + 1)
    terms = [rng.standard_normal(x.shape).astype("float32") for _ in range(n_terms - 1)]
    terms = [x - sum(terms, np.zeros_like(x))] + terms
    locals_ = {}
    for r in current_world().local_ranks(mesh.process_ids):
        c = mesh.coords_of(r)
        k = int(np.ravel_multi_index([c[i] for i in pdims], [mesh.shape[i] for i in pdims])) if pdims else 0
        locals_[r] = paddle.to_tensor(np.ascontiguousarray(terms[k][spec.local_slices(c)]))
    return ap.dtensor_from_local(locals_, mesh, placements, global_shape=list(x.shape))


def all_ranks_agree(flag: bool) -> bool:
    """True only if every rank's flag is True (an all_reduce MIN in a real job)."""
    world = current_world()
    if world.is_simulated or world.world_size == 1:
        return bool(flag)
    import paddle.distributed as dist

    t = paddle.to_tensor([1 if flag else 0], dtype="int32")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.numpy()[0])


def run_transition(mesh, shape, src, dst, seed=0, expect=None) -> dict:
    """Plan, execute and verify one reshard. ``expect`` (default ``dst``) is the placement every rank's
    shard is checked against; a wrong one makes the check fail (negative control)."""
    src_p, dst_p = parse_placements(src), parse_placements(dst)
    want = DistSpec(mesh, parse_placements(expect or dst), tuple(shape), "float32")
    if want.partial_mesh_dims():
        raise ValueError(f"expected a placement without Partial to check shards against, got {expect or dst}")
    x = full_tensor(shape, seed)
    dt = make_source(x, mesh, src_p, seed)
    plan = plan_reshard(tuple(shape), "float32", mesh, src_p, dst_p, cluster=planning_cluster())
    world = current_world()
    if not world.is_simulated and world.world_size > 1:
        import paddle.distributed as dist

        dist.barrier()
    start = time.perf_counter()
    with count_comm() as log:
        y = ap.reshard(dt, mesh, dst_p)
    seconds = time.perf_counter() - start
    bad = []
    for r, t in y.locals.items():
        got, exp = t.numpy(), expected_local(x, want, mesh.coords_of(r))
        if got.shape != exp.shape or not np.allclose(got, exp, rtol=RTOL, atol=ATOL):
            bad.append(r)
    return {"src": src, "dst": dst, "plan": plan, "ok": all_ranks_agree(not bad), "bad_ranks": bad,
            "seconds": seconds, "bytes_sent": log.bytes_sent, "collectives": [s.collective for s in plan.steps]}


def run_demo(transitions=TRANSITIONS, out=print) -> list:
    """Every transition on this world's mesh; ``out`` prints (rank 0 only in a real job)."""
    world = current_world()
    n = world.world_size
    mesh = demo_mesh(n)
    say = out if world.rank == 0 else (lambda *a, **k: None)
    say(f"reshard demo on {n} ranks, mesh {mesh.short()} {mesh.mesh.tolist()} dims {mesh.dim_names}, "
        f"backend {world.backend}\n")
    results = []
    for k, (what, shape, src, dst) in enumerate(transitions, 1):
        res = run_transition(mesh, shape, src, dst, seed=k)
        results.append(res)
        say(f"[{k}/{len(transitions)}] {what}")
        say(str(res["plan"]))
        verdict = f"all {mesh.size} ranks hold the right shard" if res["ok"] else "MISMATCH on some rank"
        plan_bytes = fmt_bytes(res["plan"].bytes_per_rank)
        sent = "collectives computed in-process (simulated world)" if world.is_simulated else \
            f"rank {world.rank} sent {fmt_bytes(res['bytes_sent'])} (plan: {plan_bytes} per rank)"
        say(f"  executed in {fmt_seconds(res['seconds'])}; {sent}; {verdict}\n")
    ok = sum(r["ok"] for r in results)
    sent = "" if world.is_simulated else (
        f"; rank {world.rank} sent {fmt_bytes(sum(r['bytes_sent'] for r in results))} in total "
        f"(plans: {fmt_bytes(sum(r['plan'].bytes_per_rank for r in results))})")
    say(f"summary: {ok}/{len(results)} reshards verified against the full tensor on {mesh.size} ranks{sent}")
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Under paddle.distributed.launch every rank runs it with no arguments.")
    p.add_argument("--simulate", type=int, default=None, metavar="N",
                   help="run all N ranks in this process (the simulated world) instead of under a launcher")
    return p


def main(argv=None) -> int:
    import paddle.distributed as dist

    parser = build_parser()
    args = parser.parse_args(argv)
    launched = int(os.environ.get("PADDLE_TRAINERS_NUM", "1")) > 1
    if args.simulate is not None:
        if launched:
            parser.error("--simulate runs every rank in one process; do not start it under a launcher")
        if args.simulate < 2 or args.simulate % 2:
            parser.error(f"--simulate needs an even number of ranks >= 2 (a 2 x N/2 mesh), got {args.simulate}")
        with ap.simulate(world_size=args.simulate):
            results = run_demo()
    else:
        if not launched:
            parser.error("one process is not a distributed job: start it with python -m paddle.distributed.launch "
                         "--nproc_per_node 4 (or autoparallel demo), or pass --simulate 4")
        dist.init_parallel_env()
        results = run_demo()
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
