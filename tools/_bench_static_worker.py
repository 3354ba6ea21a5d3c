"""One rank of tools/bench/static.py: the article's training step on the example GPT, eager vs
``@paddle.jit.to_static`` (lowered to a per-rank paddle static program), for each model size.

    _bench_static_worker.py '<json config>'

Per size: median step time (forward, backward, optimizer step) of each mode after warm-up, the time of
the first (program-building) call, and the losses of both modes (same initialisation and data, so equal).
"""
import json
import statistics
import sys
import time


import numpy as np  # noqa: E402
import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel.graph.jit import lowering_state
from autoparallel.testing.launch import write_result  # noqa: E402
from autoparallel.testing.models import tp_plan  # noqa: E402


def build(size, seed=0):
    from examples.models import GPT, GPTConfig

    paddle.seed(seed)
    return GPT(GPTConfig(vocab_size=size["vocab"], hidden=size["hidden"], layers=size["layers"],
                         heads=size["heads"], max_positions=size["seq"]))


def data(size, step):
    rng = np.random.default_rng(step)
    shape = (size["batch"], size["seq"])
    ids, labels = rng.integers(0, size["vocab"], shape), rng.integers(0, size["vocab"], shape)
    return paddle.to_tensor(ids), paddle.to_tensor(labels)


def run_mode(size, cfg, lowered):
    model = build(size)
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    s = ap.Strategy()
    s.data_parallel.degree = cfg["dp"]
    s.tensor_parallel.degree = cfg["tp"]
    model, opt = ap.parallelize(model, opt, strategy=s, tp_plan=tp_plan("gpt") if cfg["tp"] > 1 else None)

    def train_step(ids, labels):
        with ap.parallel_guard(["data"]):
            logits = model(ids)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, labels))
        return loss

    step_fn = paddle.jit.to_static(train_step) if lowered else train_step
    times, losses = [], []
    for step in range(cfg["warmup"] + cfg["steps"]):
        ids, labels = data(size, step)
        if cfg["world"] > 1:
            dist.barrier()
        t0 = time.perf_counter()
        loss = step_fn(ids, labels)
        loss.backward()
        opt.step()
        opt.clear_grad()
        value = float(loss)
        times.append(time.perf_counter() - t0)
        losses.append(value)
    why = None
    if lowered:
        state = lowering_state(step_fn) or {}
        why = state.get("why")
    return {"first": times[0], "median": statistics.median(times[cfg["warmup"]:]), "losses": losses, "why": why}


def main():
    cfg = json.loads(sys.argv[1])
    if cfg["world"] > 1:
        dist.init_parallel_env()
    out = {"rank": dist.get_rank() if cfg["world"] > 1 else 0, "sizes": []}
    for size in cfg["sizes"]:
        eager = run_mode(size, cfg, False)
        static = run_mode(size, cfg, True)
        out["sizes"].append({"size": size, "eager": eager, "static": static})
    write_result(out)


if __name__ == "__main__":
    main()
