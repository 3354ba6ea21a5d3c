"""One rank of ``autoparallel calibrate``: started by ``paddle.distributed.launch`` on every rank.

Every measurement runs on all ranks at once, each repetition starting after a barrier, so each figure is
what one rank gets while the others work too (on a CPU the ranks share the cores). The worker reports raw
per-repetition times; calibrate.py combines the ranks (a synchronous step waits for the slowest one).
Argument: a JSON object with ``sizes`` (bytes per rank of the collective messages), ``repeat`` and
``groups`` (group sizes). Writes, through ``write_result``:

    collectives: {"all_reduce/4": {"bytes": [...], "after": [[seconds per repetition] per size],
                  "work": [seconds per repetition], "factor": 1.0}, ...}: each call timed after a burst of
                 eager ops (a tiny model's forward, ``work``), as collectives run in training
    runtime:     per-repetition seconds of 200 plain eager ops, of the tiny model's forward and backward
                 (``ops`` dispatched ops), of forward + backward with and without full recompute of its
                 block (``recomputed_ops`` ops run again) and of an AdamW step over its ``tensors`` tensors
    device:      per-repetition seconds of float32 matmuls (``flop``) and of an array copy (``bytes``)
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

GROUP_COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_to_all")


# ---- collectives -------------------------------------------------------------------------------------
def _group_call(transport, name, rank, ranks, nbytes):
    """A callable running ``name`` over ``ranks`` with ``nbytes`` bytes held by this rank (float32)."""
    import paddle

    n = len(ranks)
    numel = max(n, (int(nbytes) // 4) // n * n)
    x = paddle.ones([numel], dtype="float32")
    if name == "all_reduce":
        return lambda: transport.all_reduce({rank: x}, ranks, "sum"), numel * 4
    if name == "all_gather":
        return lambda: transport.all_gather({rank: x}, ranks), numel * 4
    if name == "broadcast":
        return lambda: transport.broadcast({rank: x}, ranks, ranks[0]), numel * 4
    if name == "reduce_scatter":
        return lambda: transport.reduce_scatter({rank: x}, ranks, "sum", 0), numel * 4
    if name == "all_to_all":
        chunks = list(paddle.split(x, n))
        return lambda: transport.all_to_all({rank: chunks}, ranks), numel * 4
    raise ValueError(f"unknown collective {name!r}")


def _ping_pong(transport, rank, pair, nbytes):
    """Seconds per one-way message between the two ranks of ``pair`` (a round trip, halved)."""
    import paddle

    numel = max(1, int(nbytes) // 4)
    x = paddle.ones([numel], dtype="float32")
    a, b = pair
    like = {a: ([numel], "float32"), b: ([numel], "float32")}

    def round_trip():
        transport.send_recv({rank: x}, [(a, b)], like)
        transport.send_recv({rank: x}, [(b, a)], like)
    return round_trip, numel * 4


def _after_work(calls, work, repeat: int, barrier):
    """(work alone, [work then call]) seconds per repetition: a call's cost as training meets it, after a
    burst of eager ops (the ranks arrive as unevenly as the shared cores let them). Calls are sampled
    round-robin, so a slow spell of the machine spreads over all of them instead of skewing one."""
    for fn in calls:
        fn()
    alone, both = [], [[] for _ in calls]
    for _ in range(repeat):
        barrier()
        start = time.perf_counter()
        work()
        alone.append(time.perf_counter() - start)
        for i, fn in enumerate(calls):
            barrier()
            start = time.perf_counter()
            work()
            fn()
            both[i].append(time.perf_counter() - start)
    return alone, both


def measure_collectives(sizes, repeat, groups, work) -> dict:
    """Raw timings of every collective and group size (all groups of a size at once), each call timed
    after ``work`` (see ``_after_work`` and the module docstring)."""
    import paddle.distributed as dist

    from autoparallel.comm.transport import transport_for
    from autoparallel.comm.world import current_world
    from autoparallel.core.mesh import ProcessMesh

    world, rank = dist.get_world_size(), dist.get_rank()
    transport = transport_for(current_world())
    out = {}
    for n in groups:
        mesh = ProcessMesh(np.arange(world).reshape(world // n, n).tolist(), dim_names=["data", "model"])
        ranks = next(g for g in mesh.all_groups("model") if rank in g)
        items = []                                          # (key, bytes, callable, seconds per message factor)
        for name in GROUP_COLLECTIVES:
            for size in sizes:
                fn, nbytes = _group_call(transport, name, rank, ranks, size)
                items.append((f"{name}/{n}", nbytes, fn, 1.0))
        if n == 2:
            for size in sizes:
                fn, nbytes = _ping_pong(transport, rank, ranks, size)
                items.append(("send_recv/2", nbytes, fn, 0.5))
        alone, both = _after_work([fn for _, _, fn, _ in items], work, repeat, dist.barrier)
        for (key, nbytes, _, factor), times in zip(items, both):
            entry = out.setdefault(key, {"bytes": [], "after": [], "work": alone, "factor": factor})
            entry["bytes"].append(nbytes)
            entry["after"].append(times)
    return out


# ---- eager runtime -----------------------------------------------------------------------------------
def _tiny_lm():
    """A one-block transformer language model (the op mix of the examples: embedding, pre-norm attention
    with a causal mask, GELU MLP, final norm, LM head) on tiny tensors, as paddle Layers."""
    import math

    import paddle
    import paddle.nn.functional as F
    from paddle import nn

    d, heads, vocab = 16, 2, 64

    class Block(nn.Layer):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = paddle.split(self.qkv(self.ln1(x)).reshape([b, t, heads, 3 * d // heads]), 3, axis=-1)
            q, k, v = (z.transpose([0, 2, 1, 3]) for z in (q, k, v))
            s = paddle.matmul(q, k, transpose_y=True) * (1.0 / math.sqrt(d // heads))
            mask = paddle.triu(paddle.full([t, t], float("-inf"), dtype=s.dtype), diagonal=1)
            a = paddle.matmul(F.softmax(s + mask, axis=-1), v).transpose([0, 2, 1, 3]).reshape([b, t, d])
            x = x + self.proj(a)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class TinyLM(nn.Layer):
        def __init__(self):
            super().__init__()
            self.emb, self.blocks, self.ln_f = nn.Embedding(vocab, d), nn.LayerList([Block()]), nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias_attr=False)

        def forward(self, ids):
            return self.head(self.ln_f(self.blocks[0](self.emb(ids))))

    return TinyLM(), vocab


def _count_dispatched(fn) -> int:
    from autoparallel import dispatch

    count = [0]
    original = dispatch.run

    def counting(*args):
        count[0] += 1
        return original(*args)

    dispatch.run = counting
    try:
        fn()
    finally:
        dispatch.run = original
    return count[0]


def _times(fn, repeat: int, barrier) -> list:
    """Seconds of ``fn`` per repetition after one warm-up call; every rank starts together."""
    fn()
    times = []
    for _ in range(repeat):
        barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _replicated_lm(world, recompute=False):
    """(model, optimizer, ids, labels, forward+loss) of the tiny model replicated on every rank."""
    import paddle
    import paddle.nn.functional as F

    import autoparallel as ap
    from autoparallel.parallel.recompute import apply_ac

    paddle.seed(0)
    model, vocab = _tiny_lm()
    mesh = ap.ProcessMesh([list(range(world))], dim_names=["data", "model"])
    ap.shard_layer(model, mesh)
    if recompute:
        apply_ac(model, "full")
    opt = ap.shard_optimizer(paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters()))
    rep = [ap.Replicate(), ap.Replicate()]
    ids = ap.shard_tensor(paddle.randint(0, vocab, [2, 8]), mesh, rep)
    labels = ap.shard_tensor(paddle.randint(0, vocab, [2, 8]), mesh, rep)
    return model, opt, ids, (lambda: F.cross_entropy(model(ids), labels))


def measure_runtime(repeat):
    """Raw timings of 200 plain eager ops, of a tiny transformer language model's forward and backward
    (replicated on every rank: no communication), of forward + backward with and without full recompute
    of its block, and of its AdamW step, every rank running the same work at once; and the model's
    forward (the eager work collectives are timed after)."""
    import paddle
    import paddle.distributed as dist

    world = dist.get_world_size()
    a = paddle.ones([8, 8])
    plain_ops = 200

    def plain():
        for _ in range(plain_ops):
            a + a

    model, opt, ids, forward = _replicated_lm(world)
    ops = _count_dispatched(forward)
    block_ops = _count_dispatched(lambda: model.blocks[0](model.emb(ids)))
    block_ops -= _count_dispatched(lambda: model.emb(ids))
    rc_model, _, _, rc_forward = _replicated_lm(world, recompute=True)

    def timed_backward():
        loss = forward()
        dist.barrier()
        start = time.perf_counter()
        loss.backward()
        return time.perf_counter() - start
    timed_backward()
    train = lambda f: (lambda: f().backward())                     # noqa: E731
    out = {"plain": _times(plain, repeat, dist.barrier), "plain_ops": plain_ops,
           "forward": _times(forward, repeat, dist.barrier), "backward": [timed_backward() for _ in range(repeat)],
           "step": _times(opt.step, repeat, dist.barrier), "ops": ops, "tensors": len(model.parameters())}
    both = _interleaved([train(forward), train(rc_forward)], repeat, dist.barrier)
    out.update(train=both[0], train_recompute=both[1], recomputed_ops=block_ops)
    return out, (lambda: model(ids))


def _interleaved(fns, repeat, barrier) -> list:
    """Seconds per repetition of each of ``fns``, sampled alternately (a slow spell hits all alike)."""
    for fn in fns:
        fn()
    out = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            barrier()
            start = time.perf_counter()
            fn()
            out[i].append(time.perf_counter() - start)
    return out


def measure_device(repeat, n=256) -> dict:
    """Raw timings of float32 matmuls and of an array copy of one rank while the others run them too."""
    import paddle
    import paddle.distributed as dist

    pa = paddle.randn([n, n])
    pb = paddle.randn([n, n])
    loops = 8

    def mm():
        for _ in range(loops):
            paddle.matmul(pa, pb)
    src = np.ones(2 ** 20, dtype=np.float64)          # 8 MB
    dst = np.empty_like(src)
    return {"matmul": _times(mm, repeat, dist.barrier), "flop": 2.0 * n ** 3 * loops, "matmul_n": n,
            "copy": _times(lambda: np.copyto(dst, src), repeat, dist.barrier), "bytes": 2.0 * src.nbytes}


def main(argv) -> None:
    import paddle.distributed as dist

    from autoparallel.testing.launch import write_result

    config = json.loads(argv[0])
    dist.init_parallel_env()
    out = {"world": dist.get_world_size(), "rank": dist.get_rank()}
    out["runtime"], work = measure_runtime(config["repeat"])
    out["collectives"] = measure_collectives(config["sizes"], config["repeat"], config["groups"], work)
    out["device"] = measure_device(config["repeat"])
    write_result(out)


if __name__ == "__main__":
    main(sys.argv[1:])
