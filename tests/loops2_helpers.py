"""Shared pieces of the tests/test_probe_loops2_*.py probes: a small MLP, the distributed builds it is run
under (shard_layer on a [dp, mp] mesh with ZeRO stages, ap.parallelize, ap.DataParallel), and a comparison of
losses and every parameter against the same loop in one process."""
import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

import autoparallel as ap
from test_probe_loop_forms import tp_fn

RNG = np.random.default_rng(0)
XS = [RNG.standard_normal((8, 6)).astype("float32") for _ in range(6)]
YS = [RNG.standard_normal((8, 4)).astype("float32") for _ in range(6)]


class MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(F.tanh(self.fc1(x)))


class One:
    """The single-process run: model, optimizer wrapping, input placement."""
    def model(self):
        paddle.seed(3)
        return MLP()

    def wrap(self, m, opt):
        return m, opt

    def x(self, a):
        return paddle.to_tensor(a)


class Mesh2x2(One):
    """shard_layer on a [dp, mp] mesh (fc1 / fc2 tensor parallel unless tp=False), shard_optimizer with an
    optional ZeRO stage over dp."""
    def __init__(self, stage=None, tp=True):
        self.stage, self.tp = stage, tp

    def model(self):
        self.mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        return ap.shard_layer(super().model(), self.mesh, tp_fn if self.tp else None)

    def wrap(self, m, opt):
        return m, ap.shard_optimizer(opt, None if self.stage is None else self.stage("dp", self.mesh))

    def x(self, a):
        return ap.shard_tensor(paddle.to_tensor(a), self.mesh, [ap.Shard(0), ap.Replicate()])


class Parallelize(One):
    """ap.parallelize over 4 ranks (tp=2: fc1 column-, fc2 row-parallel), an optional ZeRO stage; plain inputs
    (the global batch, sharded by the model's input hook)."""
    def __init__(self, stage=0, tp=1, seed_style=False):
        self.stage, self.tp, self.seed_style = stage, tp, seed_style

    def wrap(self, m, opt):
        s = ap.Strategy()
        s.data_parallel.degree, s.tensor_parallel.degree = 4 // self.tp, self.tp
        if self.stage:
            s.sharding.enable, s.sharding.stage = True, self.stage
        plan = {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()} if self.tp > 1 else None
        if self.seed_style:
            return ap.DataParallel(m, strategy=s), ap.Optimizer(opt)
        return ap.parallelize(m, opt, strategy=s, tp_plan=plan)


RUNS = {"dp x tp": lambda: Mesh2x2(), "zero1": lambda: Mesh2x2(ap.ShardingStage1),
        "zero2": lambda: Mesh2x2(ap.ShardingStage2), "zero3": lambda: Mesh2x2(ap.ShardingStage3, tp=False),
        "parallelize dp": lambda: Parallelize(), "parallelize tp": lambda: Parallelize(tp=2),
        "parallelize zero2": lambda: Parallelize(2), "parallelize zero3": lambda: Parallelize(3),
        "DataParallel": lambda: Parallelize(seed_style=True)}


def full(t):
    return (t.full() if ap.is_dist(t) else t).numpy()


def params(m) -> dict:
    return {n: full(p) for n, p in m.named_parameters()}


def compare(want, got, tol=1e-4) -> float:
    """The largest difference of the losses and of every parameter; raises when one exceeds ``tol``."""
    np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)
    for n, v in want[1].items():
        np.testing.assert_allclose(got[1][n], v, rtol=tol, atol=tol, err_msg=n)
    return max([abs(a - b) for a, b in zip(got[0], want[0])] +
               [float(np.abs(got[1][n] - v).max()) for n, v in want[1].items()])


def both(run, probe, tol=1e-4):
    """``probe(env)`` -> (losses, params) in one process and under ``RUNS[run]`` in a 4-rank simulated world."""
    want = probe(One())
    with ap.simulate(world_size=4):
        got = probe(RUNS[run]())
    return compare(want, got, tol)
