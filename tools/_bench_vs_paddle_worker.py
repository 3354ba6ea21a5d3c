"""One run of tools/bench/vs_paddle.py: the same GPT, the same placements, one implementation.

    --impl single      one process, the whole batch, plain paddle (no launcher)
    --impl ours        dp x tp ranks: ap.parallelize(model, opt, Strategy(dp, tp)) (default GPT plan)
    --impl paddle      dp x tp ranks: paddle.distributed.shard_layer / shard_tensor / shard_optimizer with the
                       same placements (Paddle's dygraph semi-auto parallel)
    --impl paddle_dp   dp ranks (tp = 1): paddle.DataParallel, each rank training on its rows of the batch

``--model pf-llama``: PaddleFormers' Llama (``fuse_rms_norm=False``, intermediate 4 x hidden, kv heads = heads)
instead of the GPT (its loss is the model's own, from ``labels``); Paddle semi-auto places it by the same
Megatron plan written per PaddleFormers layer name (``PF_LLAMA_PLAN``).

Every implementation starts from the same weights (same seed) and trains on the same fixed global batch with
AdamW. A step is forward + cross-entropy + backward + optimizer step + clear_grad + the loss as a python
float; each timed step starts after a barrier and counts as the slowest rank's wall time. The loss of every
step is returned (for paddle_dp: the mean of the ranks' losses, gathered after timing), so each run can be
checked against the single process. Beside the wall time, each step's CPU time (``time.process_time``, all of
the process's threads) is summed over the ranks: on cores shared by more processes than cores, the step can
be no faster than that sum over the cores, whatever the scheduling.
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import time


import paddle                                             # noqa: E402
import paddle.distributed as dist                         # noqa: E402
import paddle.nn.functional as F                          # noqa: E402

from _bench_dispatch_worker import (DIM_NAMES, STYLE_PLACEMENTS, adamw, barrier, make_batch, over_ranks,  # noqa: E402
                                    report)
from _bench_dispatch_worker import build_model as _build_gpt  # noqa: E402
from autoparallel.testing.models import GPT_PLAN           # noqa: E402
from autoparallel.testing.launch import write_result     # noqa: E402
from tools.bench.common import GPT_ARGS, add_int_args


def mesh_ranks(dp: int, tp: int) -> list:
    return [[d * tp + t for t in range(tp)] for d in range(dp)]


def build_model(args):
    if args.model == "gpt":
        return _build_gpt(args)
    from autoparallel.testing import paddleformers_models as pf

    return pf.build("llama", args.seed, vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                    num_attention_heads=args.heads, num_key_value_heads=args.heads, intermediate_size=4 * args.hidden,
                    max_position_embeddings=max(args.seq, 64))


def setup_single(args):
    model = build_model(args)
    ids, labels = (paddle.to_tensor(a) for a in make_batch(args))
    return model, adamw(args, model.parameters()), ids, labels


def setup_ours(args):
    import autoparallel as ap

    model = build_model(args)
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = args.dp, args.tp
    model, opt = ap.parallelize(model, adamw(args, model.parameters()), strategy=s)
    ids, labels = (paddle.to_tensor(a) for a in make_batch(args))     # the global batch; sharded on entry
    return model, opt, ids, labels


# the Megatron plan of ours' default for PaddleFormers' Llama, by its layer names (for Paddle semi-auto)
PF_LLAMA_PLAN = {"*layers.*.self_attn.q_proj": "col", "*layers.*.self_attn.k_proj": "col",
                 "*layers.*.self_attn.v_proj": "col", "*layers.*.self_attn.o_proj": "row",
                 "*layers.*.mlp.gate_proj": "col", "*layers.*.mlp.up_proj": "col", "*layers.*.mlp.down_proj": "row",
                 "*embed_tokens": "vocab", "lm_head": "vocab"}     # its weight is [vocab, hidden]: split on vocab


def placements(plan: dict, name: str, param_name: str) -> list:
    """Paddle placements of one parameter on the ("data", "model") mesh: its style's shard on "model"."""
    out = [dist.Replicate(), dist.Replicate()]
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(name, pattern) and param_name in STYLE_PLACEMENTS[style]:
            out[1] = dist.Shard(STYLE_PLACEMENTS[style][param_name])
    return out


def setup_paddle(args):
    """Paddle's dygraph semi-auto API (shard_layer / shard_tensor / shard_optimizer), the same placements."""
    mesh = dist.ProcessMesh(mesh_ranks(args.dp, args.tp), dim_names=DIM_NAMES)
    model = build_model(args)
    plan = GPT_PLAN if args.model == "gpt" else PF_LLAMA_PLAN
    sharded = []

    def shard_fn(name, layer, mesh):
        # every parameter placed explicitly with one placement per mesh dim
        for pname, p in list(layer._parameters.items()):
            if p is not None and not p.is_dist():
                pl = placements(plan, name, pname)
                if any(x.is_shard() for x in pl):
                    sharded.append(name)
                setattr(layer, pname, dist.shard_tensor(p, mesh, pl))

    dist.shard_layer(model, mesh, shard_fn)
    if args.tp > 1 and not sharded:
        raise SystemExit(f"no parameter of the {args.model} matched the plan {sorted(plan)}")
    opt = dist.shard_optimizer(adamw(args, model.parameters()))
    batch = [dist.Shard(0), dist.Replicate()]
    ids, labels = (dist.shard_tensor(paddle.to_tensor(a), mesh, batch) for a in make_batch(args))
    return model, opt, ids, labels


def setup_paddle_dp(args):
    if args.tp != 1:
        raise SystemExit("--impl paddle_dp is data parallel only (tp must be 1)")
    model = paddle.DataParallel(build_model(args))
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * args.batch // n, (rank + 1) * args.batch // n)
    ids, labels = (paddle.to_tensor(a[rows]) for a in make_batch(args))
    return model, adamw(args, model.parameters()), ids, labels


SETUP = {"single": setup_single, "ours": setup_ours, "paddle": setup_paddle, "paddle_dp": setup_paddle_dp}


def step(model, opt, ids, labels) -> float:
    if isinstance(model, paddle.nn.Layer) and type(model).__name__ == "LlamaForCausalLM":
        from autoparallel.testing.paddleformers_models import loss_of

        loss = loss_of(model(input_ids=ids, labels=labels))
    else:
        loss = F.cross_entropy(model(ids), labels)
    loss.backward()
    opt.step()
    opt.clear_grad()
    return float(loss)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=sorted(SETUP), required=True)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    add_int_args(p, GPT_ARGS + (("seed", 0), ("warmup", 3), ("steps", 10)))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--model", choices=("gpt", "pf-llama"), default="gpt")
    p.add_argument("--categories", action="store_true",
                   help="after timing: rank 0's CPU per step by category over --steps more steps")
    args = p.parse_args()
    if args.impl != "single":
        dist.init_parallel_env()
        if dist.get_world_size() != args.dp * args.tp:
            raise SystemExit(f"dp x tp = {args.dp * args.tp} but {dist.get_world_size()} ranks were launched")
    rank = dist.get_rank() if dist.is_initialized() else 0
    progress = os.environ.get("AP_BENCH_PROGRESS") if rank == 0 else None
    model, opt, ids, labels = SETUP[args.impl](args)
    losses, times, cpu = [], [], []
    for i in range(args.warmup + args.steps):
        barrier()
        start, cpu0 = time.perf_counter(), time.process_time()
        losses.append(step(model, opt, ids, labels))
        if i >= args.warmup:
            times.append([time.perf_counter() - start])
            cpu.append([time.process_time() - cpu0])
        report(progress, f"{args.impl} step {i}")
    times = [t[0] for t in over_ranks(times, dist.ReduceOp.MAX)]
    cpu = [t[0] for t in over_ranks(cpu, dist.ReduceOp.SUM)]
    if args.impl == "paddle_dp":                              # each rank saw its rows: the mean is the loss
        losses = [x / dist.get_world_size() for x in over_ranks([losses], dist.ReduceOp.SUM)[0]]
    result = {"impl": args.impl, "losses": losses, "times": times, "cpu": cpu,
              "threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0)}
    if args.categories:
        from _profile_step_worker import cpu_categories

        result["categories"] = cpu_categories(lambda: step(model, opt, ids, labels), args.steps)
    write_result(result)


if __name__ == "__main__":
    main()
