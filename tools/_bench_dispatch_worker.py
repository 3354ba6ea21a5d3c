"""One run of the GPT training-step benchmark (launched by tools/bench/dispatch.py).

    --impl single   one process, the whole batch, plain paddle (no launcher)
    --impl ours     4 ranks, DP2xTP2: ap.apply_tp + ap.shard_layer + ap.shard_optimizer
    --impl paddle   4 ranks, DP2xTP2: paddle.distributed.shard_layer / shard_tensor / shard_optimizer

The same GPT (same seed, so the same initial weights), the same fixed batch every step, AdamW. A step is
forward + cross-entropy + backward + optimizer step + clear_grad + reading the loss as a python float.
Warm-up steps, then timed steps, each after a barrier; a step's time is the slowest rank's, its CPU time
the sum over ranks of ``time.process_time()`` (the work done, less sensitive to a shared machine). Every step's
loss is recorded, so the runs can be compared with the single process step by step. ``--profile N`` adds N
profiled steps on rank 0 (cProfile, CPU-time clock) after timing; ours also counts its collectives over one step.
"""
from __future__ import annotations

import argparse
import cProfile
import fnmatch
import os
import pstats
import re
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

import numpy as np                                        # noqa: E402
import paddle                                             # noqa: E402
import paddle.distributed as dist                         # noqa: E402
import paddle.nn.functional as F                          # noqa: E402

from autoparallel.testing.launch import write_result     # noqa: E402  (does not install dispatch)
from autoparallel.testing.models import GPT_PLAN         # noqa: E402
from examples.models import GPT, GPTConfig               # noqa: E402
from tools.bench.common import GPT_ARGS, add_int_args

MESH = [[0, 1], [2, 3]]
DIM_NAMES = ["data", "model"]
# the tensor-parallel styles of GPT_PLAN as (parameter -> placement on the "model" mesh dim)
STYLE_PLACEMENTS = {"col": {"weight": 1, "bias": 0}, "row": {"weight": 0}, "vocab": {"weight": 0}}


def model_config(args) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                     max_positions=args.seq)


def make_batch(args):
    rng = np.random.default_rng(args.seed)
    shape = (args.batch, args.seq)
    return rng.integers(0, args.vocab, shape), rng.integers(0, args.vocab, shape)


def build_model(args):
    paddle.seed(args.seed)
    return GPT(model_config(args))


def adamw(args, params):
    return paddle.optimizer.AdamW(learning_rate=args.lr, parameters=params)


# ---- the three set-ups: each returns (model, optimizer, ids, labels, parameter layout) ------------------------
def setup_single(args):
    model = build_model(args)
    opt = adamw(args, model.parameters())
    ids, labels = (paddle.to_tensor(a) for a in make_batch(args))
    return model, opt, ids, labels, {}


def setup_ours(args):
    import autoparallel as ap
    from autoparallel.testing.models import tp_plan

    mesh = ap.ProcessMesh(MESH, DIM_NAMES)
    model = build_model(args)
    ap.apply_tp(model, mesh, tp_plan("gpt"), "model")
    ap.shard_layer(model, mesh)
    opt = ap.shard_optimizer(adamw(args, model.parameters()))
    batch = [ap.Shard(0), ap.Replicate()]
    ids, labels = (ap.shard_tensor(paddle.to_tensor(a), mesh, batch) for a in make_batch(args))
    layout = {n: "[" + ", ".join(map(str, p.placements)) + "]" for n, p in model.named_parameters()}
    return model, opt, ids, labels, layout


def paddle_placements(name: str, param_name: str) -> list:
    """Paddle placements of one parameter: GPT_PLAN's style on the "model" dim, replicated otherwise."""
    out = [dist.Replicate(), dist.Replicate()]
    for pattern, style in GPT_PLAN.items():
        if fnmatch.fnmatchcase(name, pattern) and param_name in STYLE_PLACEMENTS[style]:
            out[1] = dist.Shard(STYLE_PLACEMENTS[style][param_name])
    return out


def setup_paddle(args, ranks=MESH):
    """Paddle's semi-auto API on a ("data", "model") mesh of ``ranks`` with GPT_PLAN's placements."""
    mesh = dist.ProcessMesh(ranks, dim_names=DIM_NAMES)
    model = build_model(args)

    def shard_fn(name, layer, mesh):
        # every parameter placed explicitly with one placement per mesh dim (paddle's own fallback for the
        # rest gives a parameter one placement per tensor dim instead)
        for pname, p in list(layer._parameters.items()):
            if p is not None and not p.is_dist():
                setattr(layer, pname, dist.shard_tensor(p, mesh, paddle_placements(name, pname)))

    dist.shard_layer(model, mesh, shard_fn)
    opt = dist.shard_optimizer(adamw(args, model.parameters()))
    batch = [dist.Shard(0), dist.Replicate()]
    ids, labels = (dist.shard_tensor(paddle.to_tensor(a), mesh, batch) for a in make_batch(args))
    layout = {n: "[" + ", ".join(_placement_str(p) for p in t.placements) + "]" for n, t in model.named_parameters()}
    return model, opt, ids, labels, layout


def _placement_str(p) -> str:
    if p.is_shard():
        return f"S({p.get_dim()})"
    return "R" if p.is_replicated() else "P"


SETUP = {"single": setup_single, "ours": setup_ours, "paddle": setup_paddle}


# ---- one training step, in phases ------------------------------------------------------------------------
PHASES = ["forward", "loss", "backward", "optimizer", "loss value"]


def train_step(model, opt, ids, labels):
    """The same code for all three set-ups; returns (loss, wall seconds per phase, CPU seconds per phase)."""
    marks = [(time.perf_counter(), time.process_time())]
    logits = model(ids)
    marks.append((time.perf_counter(), time.process_time()))
    loss = F.cross_entropy(logits, labels)
    marks.append((time.perf_counter(), time.process_time()))
    loss.backward()
    marks.append((time.perf_counter(), time.process_time()))
    opt.step()
    opt.clear_grad()
    marks.append((time.perf_counter(), time.process_time()))
    value = float(loss)
    marks.append((time.perf_counter(), time.process_time()))
    wall = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    return value, wall, cpu


def count_by_phase(model, opt, ids, labels) -> dict:
    """One more step of ours with the collectives of each phase counted by wrapping ``paddle.distributed``:
    {phase: [[collective, bytes this rank sent, group size], ...]}."""
    from autoparallel.comm.counter import count_comm

    logs = {}
    with count_comm() as logs["forward"]:
        logits = model(ids)
    with count_comm() as logs["loss"]:
        loss = F.cross_entropy(logits, labels)
    with count_comm() as logs["backward"]:
        loss.backward()
    with count_comm() as logs["optimizer"]:
        opt.step()
        opt.clear_grad()
    with count_comm() as logs["loss value"]:
        float(loss)
    return {k: [list(c) for c in log.calls] for k, log in logs.items()}


def over_ranks(rows: list, op) -> list:
    """Elementwise reduction over ranks (``dist.ReduceOp.MAX`` or ``SUM``) of a list of rows of seconds."""
    if not dist.is_initialized() or not rows:
        return rows
    t = paddle.to_tensor(np.asarray(rows, dtype="float64"))
    dist.all_reduce(t, op=op)
    return t.numpy().tolist()


def barrier():
    if dist.is_initialized():
        dist.barrier()


def report(progress, text):
    if progress:
        with open(progress, "a") as f:
            f.write(text + "\n")


# ---- profile (rank 0) ---------------------------------------------------------------------------------------
COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "barrier", "send", "recv", "alltoall")


def _group(path: str, fn: str) -> str:
    """Where a profiled function's own time goes."""
    if path == "~":
        if any(c in fn for c in COLLECTIVES):
            return "gloo collectives"
        if "run_backward" in fn:
            return "paddle autograd engine + backward kernels"
        return "paddle forward/optimizer kernels" if "paddle" in fn else "other built-ins"
    rel = os.path.relpath(path, ROOT) if path.startswith(ROOT) else path
    for prefix, name in (("autoparallel/", "autoparallel (python)"), ("spmd_rules/", "spmd_rules (python)"),
                         ("reshard/", "reshard planner (python)"), ("examples/", "model code (python)"),
                         ("tools/", "benchmark loop")):
        if rel.startswith(prefix):
            return name
    return "paddle (python)" if "/paddle/" in path else "other python"


def profile_steps(model, opt, ids, labels, n: int, rank: int, top: int = 20):
    """cProfile ``n`` steps on rank 0 (every rank runs them) with a CPU-time clock: own CPU time per group
    and per function, per step."""
    prof = cProfile.Profile(time.process_time) if rank == 0 else None
    if prof:
        prof.enable()
    for _ in range(n):
        train_step(model, opt, ids, labels)
    if not prof:
        return None
    prof.disable()
    groups, funcs = {}, []
    for (path, line, fn), (_cc, ncalls, tt, ct, _callers) in pstats.Stats(prof).stats.items():
        g = _group(path, fn)
        groups[g] = groups.get(g, 0.0) + tt / n
        where = re.sub(r" at 0x[0-9a-f]+", "", fn) if path == "~" else f"{_short_path(path)}:{line}({fn})"
        funcs.append((tt / n, ct / n, ncalls / n, where))
    funcs.sort(reverse=True)
    return {"groups": groups, "top": funcs[:top], "total": sum(groups.values())}


def _short_path(path: str) -> str:
    if path.startswith(ROOT):
        return os.path.relpath(path, ROOT)
    return path.split("site-packages/")[-1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=sorted(SETUP), required=True)
    add_int_args(p, GPT_ARGS + (("seed", 0), ("warmup", 3), ("steps", 10), ("profile", 0)))
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()

    if args.impl != "single":
        dist.init_parallel_env()
        if dist.get_world_size() != 4:
            raise SystemExit(f"--impl {args.impl} expects 4 ranks, got {dist.get_world_size()}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    progress = os.environ.get("AP_BENCH_PROGRESS") if rank == 0 else None
    model, opt, ids, labels, layout = SETUP[args.impl](args)

    losses, wall, cpu = [], [], []
    for i in range(args.warmup + args.steps):
        barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        loss, wall_phases, cpu_phases = train_step(model, opt, ids, labels)
        total, total_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        losses.append(loss)
        if i >= args.warmup:
            wall.append([total] + wall_phases)
            cpu.append([total_cpu] + cpu_phases)
        report(progress, f"{args.impl} step {i}")
    wall = over_ranks(wall, dist.ReduceOp.MAX)      # the slowest rank
    cpu = over_ranks(cpu, dist.ReduceOp.SUM)        # the work of all ranks
    result = {"impl": args.impl, "losses": losses, "times": [r[0] for r in wall], "cpu": [c[0] for c in cpu],
              "phases": {name: [r[k + 1] for r in wall] for k, name in enumerate(PHASES)},
              "cpu_phases": {name: [c[k + 1] for c in cpu] for k, name in enumerate(PHASES)}, "layout": layout}
    if args.impl == "ours":
        result["comm"] = count_by_phase(model, opt, ids, labels)
    if args.profile:
        result["profile"] = profile_steps(model, opt, ids, labels, args.profile, rank)
        report(progress, f"{args.impl} profiled")
    write_result(result)


if __name__ == "__main__":
    main()
