"""Eager dispatch under shapes that change every step (bucketed sequence lengths, a smaller last batch).

    OMP_NUM_THREADS=1 python tools/bench_variable_shapes.py [--layout dp|tp|sp] [--steps 200] [--limit N]

In ``ap.simulate(world_size=4)`` a tiny GPT trains with three input streams: one fixed shape, 7 bucketed
lengths (32..128 by 16) and every length 17..128; the batch is 8, and 5 on every 10th step. Each stream
first runs over all of its shapes once (warm-up), then ``--steps`` steps are measured: the median step time,
the dispatch plans built per step (cache misses) and the sizes of the dispatch and reshard caches."""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def _model():
    import paddle

    from examples.models import GPT, GPTConfig

    paddle.seed(0)
    return GPT(GPTConfig(vocab_size=64, hidden=32, layers=2, heads=4, max_positions=128))


def _batches(lens, steps, seed=0):
    rng = np.random.default_rng(seed)
    for i in range(steps):
        b, t = (5 if i % 10 == 9 else 8), int(rng.choice(lens))
        yield rng.integers(0, 64, (b, t)), rng.integers(0, 64, (b, t))


def _warm_batches(lens):
    for t in lens:
        for b in (8, 5):
            yield np.zeros((b, t), "int64"), np.zeros((b, t), "int64")


def run_stream(name, lens, steps, layout):
    import paddle
    import paddle.nn.functional as F

    import autoparallel as ap
    from autoparallel import dispatch_cache
    from autoparallel.testing.models import adamw, tp_plan
    from reshard import cache as reshard_cache

    built = [0]
    store = dispatch_cache.store

    def counting_store(key, plan):
        built[0] += key is not None
        return store(key, plan)

    dispatch_cache.clear()
    dispatch_cache.store = counting_store
    try:
        with ap.simulate(world_size=4):
            s = ap.Strategy()
            kw = {}
            if layout == "dp":
                s.data_parallel.degree = 4
            else:
                s.data_parallel.degree, s.tensor_parallel.degree, kw = 2, 2, {"tp_plan": tp_plan("gpt")}
                s.sequence_parallel.enable = layout == "sp"
            m = _model()
            m, opt = ap.parallelize(m, adamw(m.parameters()), strategy=s, **kw)

            def step(x, y):
                loss = F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
                loss.backward()
                opt.step()
                opt.clear_grad()

            for x, y in _warm_batches(lens):
                step(x, y)
            built[0], times = 0, []
            for x, y in _progress(_batches(lens, steps), steps, name):
                t0 = time.perf_counter()
                step(x, y)
                times.append(time.perf_counter() - t0)
    finally:
        dispatch_cache.store = store
    return {"stream": name, "shapes": 2 * len(lens), "median ms/step": round(1e3 * statistics.median(times), 1),
            "plans built/step": round(built[0] / steps, 1), "dispatch cache": dispatch_cache.size(),
            "reshard cache": reshard_cache.size()}


def _progress(it, total, desc):
    try:
        from tqdm import tqdm
    except ImportError:
        return it
    return tqdm(it, total=total, desc=desc, leave=False)


def main(argv=None):
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--layout", choices=["dp", "tp", "sp"], default="dp")
    ap_.add_argument("--steps", type=int, default=200)
    ap_.add_argument("--limit", type=int, default=None, help="plans per dispatch table (default: the module's)")
    a = ap_.parse_args(argv)
    if a.limit:
        from autoparallel import dispatch_cache

        dispatch_cache._CACHE_LIMIT = a.limit
    streams = [("fixed", [64]), ("7 buckets", list(range(32, 129, 16))), ("every length", list(range(17, 129)))]
    rows = [run_stream(n, lens, a.steps, a.layout) for n, lens in streams]
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
