"""Memory per rank of a LoRA-shaped model (frozen base Linears, small trainable adapters) under DP and ZeRO 1-3
on 4 data ranks, next to one process: bytes of parameters, gradients and optimizer states on rank 0, counted from
live tensors after the last optimizer step (before ``clear_grad``), in ``ap.simulate(world_size=4)`` (every
rank's tensors are its own there, so the counts are the real ranks').

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench memory --lora [--hidden 512] [--layers 4] [--rank 8]

Prints a markdown table (KiB per rank); ``--json PATH`` also writes the figures.
"""
from __future__ import annotations

import json

RUNS = {"one process": None, "DP4": 0, "ZeRO-1": 1, "ZeRO-2": 2, "ZeRO-3": 3}
STATE = ("params", "grads", "optimizer_states")


def lora_model(hidden: int, layers: int, rank: int):
    import paddle
    from paddle import nn

    from autoparallel.testing.lora import HandLoRA

    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.blocks = nn.LayerList([HandLoRA(hidden, rank) for _ in range(layers)])

        def forward(self, x):
            for b in self.blocks:
                x = paddle.nn.functional.gelu(b(x))
            return x

    paddle.seed(0)
    return Net()


def bytes_of(model, opt) -> dict:
    """Rank 0's bytes: ZeRO counts its own chunks; DP and one process their parameters, gradients and states."""
    from autoparallel.dist_tensor import is_dist
    from autoparallel.memory import live_bytes
    from autoparallel.parallel.optim_clone import state_tensors

    if hasattr(opt, "memory_bytes"):
        return opt.memory_bytes(0)
    local = [p.locals[0] if is_dist(p) else p for p in model.parameters()]
    return {"params": live_bytes(local), "grads": live_bytes([t.grad for t in local]),
            "optimizer_states": live_bytes(state_tensors(getattr(opt, "_inner", opt)))}


def measure(stage, hidden: int, layers: int, rank: int, steps: int = 3) -> dict:
    import numpy as np
    import paddle

    import autoparallel as ap

    model = lora_model(hidden, layers, rank)
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    if stage is not None:
        s = ap.Strategy()
        s.data_parallel.degree = 4
        if stage:
            s.sharding.enable, s.sharding.stage = True, stage
        model, opt = ap.parallelize(model, opt, strategy=s)
    rng = np.random.default_rng(0)
    for i in range(steps):
        loss = model(paddle.to_tensor(rng.standard_normal((8, hidden)).astype("float32"))).pow(2).mean()
        loss.backward()
        opt.step()
        if i < steps - 1:
            opt.clear_grad()
    return bytes_of(model, opt)


def run(hidden: int, layers: int, rank: int) -> dict:
    import autoparallel as ap
    from tools.bench.common import progress

    out = {}
    for name, stage in progress(RUNS.items(), desc="runs", unit="run"):
        if stage is None:
            out[name] = measure(None, hidden, layers, rank)
        else:
            with ap.simulate(world_size=4):
                out[name] = measure(stage, hidden, layers, rank)
    return out


def main(args) -> int:
    from tools.bench.common import md_table

    figures = run(args.hidden, args.layers, args.rank)
    base, adapters = args.layers * (args.hidden ** 2 + args.hidden), args.layers * 2 * args.hidden * args.rank
    rows = [[name] + [f"{v[k] / 1024:.1f}" for k in STATE] + [f"{sum(v.values()) / 1024:.1f}"]
            for name, v in figures.items()]
    print(f"LoRA-shaped model: {args.layers} x Linear({args.hidden}, {args.hidden}) frozen ({base:,} parameters), "
          f"adapters r={args.rank} trainable ({adapters:,}, {adapters / (base + adapters):.1%}); AdamW fp32, "
          f"3 steps, rank 0 of 4 data ranks (KiB)\n")
    print(md_table(["run", "params", "grads", "optimizer states", "total"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0
