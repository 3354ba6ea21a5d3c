"""Runs on every rank (4): one profiled training step of the tiny GPT under DP2xTP2, TP4 and PP2xDP2, with an
independent wrapper around paddle.distributed counting the same step's calls and tensor sizes.

    profile_worker.py PLOT_DIR
Every rank reports, per config: the profile's per-kind counts and bytes, the wrapper's calls, the parts'
sum and the step time, the ranks whose breakdowns it holds; rank 0 writes PLOT_DIR/<config>.png.
"""
import os
import sys

import paddle
import paddle.distributed as dist
import paddle.nn.functional as F


import autoparallel as ap  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402
from autoparallel.testing.models import batch, build  # noqa: E402

NAMES = ("all_reduce", "all_gather", "broadcast", "send", "recv")


class Spy:
    """Counts paddle.distributed calls by name with the bytes of the tensor each rank passes in."""

    def __init__(self):
        self.calls, self.on, self.saved = [], False, {}

    def install(self):
        for n in NAMES:
            fn = self.saved[n] = getattr(dist, n)
            setattr(dist, n, lambda *a, __n=n, __f=fn, **k: self._call(__n, __f, a, k))

    def _call(self, name, fn, args, kwargs):
        if self.on:
            t = args[1] if name == "all_gather" else (args[0] if args else kwargs["tensor"])
            group = kwargs.get("group")
            size = len(group.ranks) if group is not None else dist.get_world_size()
            self.calls.append([name, int(t.numel()) * t.element_size(), size])
        return fn(*args, **kwargs)

    def remove(self):
        for n, fn in self.saved.items():
            setattr(dist, n, fn)


def run(name, dp, tp, plot_dir, pp=1):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    if pp > 1:
        s.pipeline_parallel.degree, s.pipeline_parallel.micro_batches = pp, 2
    model = build("gpt")
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    model, opt = ap.parallelize(model, opt, s)
    ids, labels = batch()

    def step():
        if pp > 1:
            model.train_batch(paddle.to_tensor(ids), paddle.to_tensor(labels))
        else:
            loss = F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(labels)).mean()
            loss.backward()
        opt.step()
        opt.clear_grad()

    step()
    spy = Spy()
    spy.install()
    try:
        p = ap.profile().start()
        spy.on = True
        step()
        spy.on = False
        p.stop()
    finally:
        spy.remove()
    me = p.breakdowns[dist.get_rank()]
    if dist.get_rank() == 0:
        p.plot(os.path.join(plot_dir, f"{name}.png"))
    return {"kinds": me.collectives, "spy": spy.calls, "parts_sum": sum(me.parts.values()), "step_s": me.step_s,
            "ranks": sorted(p.breakdowns), "waits": {r: b.parts["idle wait"] for r, b in p.breakdowns.items()},
            "bubbles": {r: b.parts["pipeline bubble"] for r, b in p.breakdowns.items()},
            "table": p.table() if dist.get_rank() == 0 else ""}


def main():
    dist.init_parallel_env()
    plot_dir = sys.argv[1]
    write_result({"dp2tp2": run("dp2tp2", 2, 2, plot_dir), "tp4": run("tp4", 1, 4, plot_dir),
                  "pp2dp2": run("pp2dp2", 2, 1, plot_dir, pp=2)})


if __name__ == "__main__":
    main()
