"""Runs on every rank (4): lazy, sharded initialisation of the tiny GPT on real gloo ranks; one launch.

    lazy_init_worker.py
Per config (TP2xDP2 + ZeRO-3 untied; TP2xDP2 tied) each rank compares its shards (ZeRO-3: master chunks)
with the slices of an eager single-process build made in this process with the same seed, records every
random draw's size (wrapping paddle's ops), whether any local data was allocated under ZeRO-3, and the
losses / final parameters of a few training steps after lazy init and after eager init.
"""
import dataclasses

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F


import autoparallel as ap  # noqa: E402
from autoparallel import layer_state  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402
from examples.models import PRESETS, build  # noqa: E402

SEED, STEPS = 5, 3
CONFIGS = {"tp2dp2_zero3": ("gpt-tiny", 3), "tied_tp2dp2": ("gpt-tiny-tied", None)}
RANDOM_OPS = ("gaussian", "uniform", "truncated_gaussian_random")


def make(preset, lazy):
    paddle.seed(SEED)
    cfg = dataclasses.replace(PRESETS[preset], vocab_size=128)
    return build(cfg, lazy=lazy)


def strategy(zero):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = 2, 2
    if zero:
        s.sharding.enable, s.sharding.stage = True, zero
    return s


class Draws:
    def __init__(self):
        self.sizes, self.saved = [], {}

    def __enter__(self):
        for op in RANDOM_OPS:
            real = self.saved[op] = getattr(paddle._C_ops, op)
            setattr(paddle._C_ops, op, self._wrap(real))
        return self

    def _wrap(self, real):
        def op(shape, *args):
            self.sizes.append(int(np.prod(shape)))
            return real(shape, *args)
        return op

    def __exit__(self, *exc):
        for op, fn in self.saved.items():
            setattr(paddle._C_ops, op, fn)


def shards(model, opt, zero, rank):
    """{name: (this rank's values, flat start, stop in the local shard, local slices, allocated)}."""
    out = {}
    for n, p in model.named_parameters():
        t = p.locals[rank]
        slices = [[s.start, s.stop] for s in p.spec.local_slices(p.mesh.coords_of(rank))]
        if zero:
            k, layout = opt.groups.index(rank), opt._layout([p], rank)
            a = layout.starts[0][k]
            out[n] = (opt.master[rank][id(p)].numpy(), a, a + layout.sizes[0][k], slices, t._is_initialized())
        else:
            v = t.numpy().reshape(-1)
            out[n] = (v, 0, v.size, slices, True)
    return out


def train(model, opt, zero):
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(STEPS):
        x, y = (paddle.to_tensor(rng.integers(0, 128, (8, 16))) for _ in range(2))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    if zero:
        opt.gather(opt.params)
    return losses, {n: p.full().numpy() for n, p in model.named_parameters()}


def run(preset, zero, rank):
    ref = make(preset, lazy=False)
    after_ref = paddle.rand([4]).numpy()
    refv = {n: p.numpy() for n, p in ref.named_parameters()}
    m = make(preset, lazy=True)
    opt = paddle.optimizer.AdamW(1e-2, parameters=m.parameters())
    with Draws() as draws:
        m, opt = ap.parallelize(m, opt, strategy(zero))
    generator_in_step = bool(np.array_equal(paddle.rand([4]).numpy(), after_ref))
    mismatched, allocated, kept = [], [], {}
    for n, (got, a, b, slices, alloc) in shards(m, opt, zero, rank).items():
        want = refv[n][tuple(slice(*s) for s in slices)].reshape(-1)[a:b]
        if not np.array_equal(got, want):
            mismatched.append(n)
        if zero and alloc:
            allocated.append(n)
        kept[n] = int(got.size)
    losses_lazy, final_lazy = train(m, opt, zero)
    e = make(preset, lazy=False)
    eopt = paddle.optimizer.AdamW(1e-2, parameters=e.parameters())
    e, eopt = ap.parallelize(e, eopt, strategy(zero))
    losses_eager, final_eager = train(e, eopt, zero)
    return {"mismatched": mismatched, "allocated_under_zero3": allocated, "generator_in_step": generator_in_step,
            "draws": draws.sizes, "kept": kept, "numel": {n: int(v.size) for n, v in refv.items()},
            "order": list(refv), "losses_lazy": losses_lazy, "losses_eager": losses_eager,
            "final_equal": all(np.array_equal(final_lazy[n], v) for n, v in final_eager.items()),
            "report_full_copies": [x.name for x in layer_state.init_report(m).full_copies()]}


def main():
    dist.init_parallel_env()
    rank = dist.get_rank()
    write_result({"rank": rank, "configs": {name: run(*cfg, rank) for name, cfg in CONFIGS.items()}})


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
