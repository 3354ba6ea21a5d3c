"""Training runs shared by the simulated-world test and the real-rank worker of the entry points."""
import paddle

from autoparallel import layer_state
import autoparallel as ap
from autoparallel.testing.models import adamw, build, train_steps

STEPS = 3


def _opt(params, clip=False):
    return adamw(params, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.05) if clip else None)


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
    losses = train_steps(m, opt, STEPS, use_async_allreduce=True)
    copies = {f"{n}@{r}": t.numpy() for n, p in m.named_parameters() for r, t in p.locals.items()}
    return losses, copies
