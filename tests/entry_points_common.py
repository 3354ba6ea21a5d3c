"""Training runs shared by the simulated-world test and the real-rank worker of the entry points."""
import numpy as np
import paddle
import paddle.nn.functional as F

from autoparallel import layer_state
import autoparallel as ap
from autoparallel.testing.models import batch, build

STEPS = 3


def _opt(params, clip=False):
    gc = paddle.nn.ClipGradByGlobalNorm(0.05) if clip else None
    return paddle.optimizer.AdamW(1e-2, parameters=params, epsilon=1e-4, grad_clip=gc)


def run(case):
    """(losses, {"name@rank": local copy}) of ``case`` on a 4-rank world (simulated or real)."""
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = (2, 2) if case == "dp_optimizer" else (4, 1)
    m = build("gpt")
    if case == "dp_optimizer":
        opt = _opt(m.parameters(), clip=True)
        m = ap.DataParallel(m, strategy=s)
        opt = ap.Optimizer(opt)
    else:
        m, _ = ap.parallelize(m, None, strategy=s)
        opt = ap.shard_optimizer(_opt(m.parameters()), ap.ShardingStage2("data", layer_state.mesh_of(m)))
    losses = []
    for i in range(STEPS):
        ids, lab = batch(i)
        loss = F.cross_entropy(m(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()
        loss.backward(use_async_allreduce=True)
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    copies = {f"{n}@{r}": t.numpy() for n, p in m.named_parameters() for r, t in p.locals.items()}
    return losses, copies
