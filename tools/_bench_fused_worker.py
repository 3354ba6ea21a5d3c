"""Rank worker of tools/bench_fused.py."""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import paddle
import paddle.distributed as dist

from autoparallel import layer_state
import autoparallel as ap
from autoparallel.comm.counter import count_comm
from autoparallel.testing import paddleformers_models as pf
from autoparallel.testing import paddleformers_runs as pc
from autoparallel.testing.launch import write_result


def build(args, plan):
    model = pf.build("phi3", 0, vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                     num_hidden_layers=args.layers, num_attention_heads=args.heads,
                     num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq)
    opt = paddle.optimizer.AdamW(1e-4, parameters=model.parameters())
    return ap.parallelize(model, opt, strategy=pc.strategy(args.dp, args.tp), tp_plan=plan)


def main():
    p = argparse.ArgumentParser()
    for name in ("dp", "tp", "vocab", "hidden", "layers", "heads", "kv_heads", "seq", "batch", "warmup", "rounds"):
        p.add_argument(f"--{name}", type=int)
    args = p.parse_args()
    dist.init_parallel_env()
    gather = ap.ColWiseParallel(gather_output=True)
    plans = {"blocked": None, "gathered": {"qkv_proj": gather, "gate_up_proj": gather}}
    paddle.seed(0)
    ids = paddle.randint(0, args.vocab, [args.batch, args.seq])
    runs = {}
    for name, plan in plans.items():
        model, opt = build(args, plan)
        tp_group = next(tuple(sorted(g)) for g in layer_state.mesh_of(model).all_groups("model") if dist.get_rank() in g)

        def step():
            loss = pf.loss_of(model(input_ids=ids, labels=ids))
            loss.backward()
            opt.step()
            opt.clear_grad()
            return float(loss)

        with count_comm() as log:
            first = step()
        comm = collections.Counter(n for (n, _, _), g in zip(log.calls, log.groups) if tuple(g) == tp_group)
        for _ in range(args.warmup):
            step()
        runs[name] = {"step": step, "loss": first, "comm": dict(comm), "times": []}
    for k in range(args.rounds):
        for name in (list(runs) if k % 2 == 0 else list(runs)[::-1]):     # alternate which plan goes first
            r = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            r["step"]()
            dist.barrier()
            r["times"].append(time.perf_counter() - t0)
    write_result({name: {"median_ms": statistics.median(r["times"]) * 1e3, "loss": r["loss"], "comm": r["comm"]}
                  for name, r in runs.items()})


if __name__ == "__main__":
    main()
