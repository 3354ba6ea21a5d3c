"""One run of tools/bench/vs_paddle.py: the same GPT, the same placements, one implementation.

    --impl single      one process, the whole batch, plain paddle (no launcher)
    --impl ours        dp x tp ranks: ap.parallelize(model, opt, Strategy(dp, tp)) (default GPT plan)
    --impl paddle      dp x tp ranks: paddle.distributed.shard_layer / shard_tensor / shard_optimizer with the
                       same placements (Paddle's dygraph semi-auto parallel)
    --impl paddle_dp   dp ranks (tp = 1): paddle.DataParallel, each rank training on its rows of the batch

``--model pf-llama``: PaddleFormers' Llama (``fuse_rms_norm=False``, intermediate 4 x hidden, kv heads = heads)
instead of the GPT, for single and ours (its loss is the model's own, from ``labels``).

Every implementation starts from the same weights (same seed) and trains on the same fixed global batch with
AdamW. A step is forward + cross-entropy + backward + optimizer step + clear_grad + the loss as a python
float; each timed step starts after a barrier and counts as the slowest rank's wall time. The loss of every
step is returned (for paddle_dp: the mean of the ranks' losses, gathered after timing), so each run can be
checked against the single process.
"""
from __future__ import annotations

import argparse
import os
import time


import paddle                                             # noqa: E402
import paddle.distributed as dist                         # noqa: E402
import paddle.nn.functional as F                          # noqa: E402

from _bench_dispatch_worker import (adamw, barrier, make_batch, over_ranks, report)  # noqa: E402
from _bench_dispatch_worker import build_model as _build_gpt  # noqa: E402
from _bench_dispatch_worker import setup_paddle as _semi_auto  # noqa: E402
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


def setup_paddle(args):
    return _semi_auto(args, mesh_ranks(args.dp, args.tp))[:4]


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
    args = p.parse_args()
    if args.impl != "single":
        dist.init_parallel_env()
        if dist.get_world_size() != args.dp * args.tp:
            raise SystemExit(f"dp x tp = {args.dp * args.tp} but {dist.get_world_size()} ranks were launched")
    rank = dist.get_rank() if dist.is_initialized() else 0
    progress = os.environ.get("AP_BENCH_PROGRESS") if rank == 0 else None
    model, opt, ids, labels = SETUP[args.impl](args)
    losses, times = [], []
    for i in range(args.warmup + args.steps):
        barrier()
        start = time.perf_counter()
        losses.append(step(model, opt, ids, labels))
        if i >= args.warmup:
            times.append([time.perf_counter() - start])
        report(progress, f"{args.impl} step {i}")
    times = [t[0] for t in over_ranks(times, dist.ReduceOp.MAX)]
    if args.impl == "paddle_dp":                              # each rank saw its rows: the mean is the loss
        losses = [x / dist.get_world_size() for x in over_ranks([losses], dist.ReduceOp.SUM)[0]]
    write_result({"impl": args.impl, "losses": losses, "times": times})


if __name__ == "__main__":
    main()
