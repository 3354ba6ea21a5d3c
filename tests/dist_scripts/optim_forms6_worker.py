"""Runs on every rank of a gloo job: optimizer, clip and weight-decay forms a paddle user writes, trained 3 steps
on real ranks; rank 0 saves each run's losses, learning rates and final parameters (whole) to
OUT_DIR/<run>-<form>.npz, compared with one process by tests/test_probe_optim_forms6.py (which builds the same
programs in one process from this module).

Forms (``FORMS``): Lamb over parameter groups with their own ``lamb_weight_decay`` / ``beta1`` / exclusion by
parameter name, and a per-tensor
``ClipGradByNorm``; Momentum (nesterov, L2Decay) with ``ClipGradByNorm``; AdamW with ``apply_decay_param_fun``,
``ClipGradByGlobalNorm(auto_skip_clip=True)`` and ``ReduceOnPlateau`` fed the distributed loss. The MLP's
``fc1.weight`` carries ``ParamAttr(regularizer=L1Decay, learning_rate=0.5)`` (overrides the optimizer's decay).

    optim_forms6_worker.py OUT_DIR          (2 ranks: MLP TP 2, MLP ZeRO-2, PaddleFormers llama TP 2)
    optim_forms6_worker.py OUT_DIR four     (4 ranks: MLP dp2 x tp2 + ZeRO-2 under ap.parallelize)
"""
import os
import sys

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

import autoparallel as ap

O, LR, R = paddle.optimizer, paddle.optimizer.lr, paddle.regularizer
STEPS = 3
RNG = np.random.default_rng(6)
XS = [RNG.standard_normal((8, 6)).astype("float32") for _ in range(STEPS)]
YS = [RNG.standard_normal((8, 4)).astype("float32") for _ in range(STEPS)]


class MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8, weight_attr=paddle.ParamAttr(regularizer=R.L1Decay(0.05), learning_rate=0.5))
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(F.tanh(self.fc1(x)))


def lamb_groups(m):
    ps = m.parameters()
    half = len(ps) // 2
    kept = {p.name for n, p in m.named_parameters() if "bias" in n or "norm" in n}
    return O.Lamb(0.05, parameters=[{"params": ps[:half], "lamb_weight_decay": 0.3, "beta1": 0.5},
                                    {"params": ps[half:], "exclude_from_weight_decay_fn": lambda p: p.name in kept}],
                  lamb_weight_decay=0.02, grad_clip=nn.ClipGradByNorm(0.05))


def momentum_norm_clip(m):
    return O.Momentum(0.1, parameters=m.parameters(), use_nesterov=True, weight_decay=R.L2Decay(0.1),
                      grad_clip=nn.ClipGradByNorm(0.01))


def adamw_plateau(m):
    """``epsilon=1e-4``: the clip scales the llama's gradients to ~1e-7, where Adam's ``g / (sqrt(v) + 1e-8)``
    turns the last-bit differences of a split matmul's sums into 1e-4 updates (both layouts are right)."""
    decay = {p.name for n, p in m.named_parameters() if "bias" not in n and "norm" not in n}
    return O.AdamW(LR.ReduceOnPlateau(0.05, patience=0, factor=0.5, threshold=10.0), parameters=m.parameters(),
                   epsilon=1e-4, weight_decay=0.1, apply_decay_param_fun=lambda n: n in decay,
                   grad_clip=nn.ClipGradByGlobalNorm(0.05, auto_skip_clip=True))


FORMS = {"lamb_groups": lamb_groups, "momentum_norm_clip": momentum_norm_clip, "adamw_plateau": adamw_plateau}


def mlp():
    paddle.seed(3)
    return MLP()


def llama():
    from autoparallel.testing import paddleformers_models as pf

    return pf.build("llama", seed=0)


def llama_batch(s):
    from autoparallel.testing import paddleformers_models as pf

    ids, labels = pf.batch(seed=s)
    return {"input_ids": paddle.to_tensor(ids), "labels": paddle.to_tensor(labels)}


def mlp_loss(m, s, place=lambda t: t):
    return F.mse_loss(m(place(paddle.to_tensor(XS[s]))), paddle.to_tensor(YS[s]))


def llama_loss(m, s, place=None):
    from autoparallel.testing import paddleformers_models as pf

    return pf.loss_of(m(**llama_batch(s)))


def train(model, opt, loss_fn):
    """3 steps; the scheduler stepped per step (ReduceOnPlateau with the loss). (losses + lrs, {name: whole})."""
    out = []
    for s in range(STEPS):
        loss = loss_fn(model, s)
        loss.backward()
        opt.step()
        opt.clear_grad()
        sched = opt._learning_rate
        if isinstance(sched, LR.ReduceOnPlateau):
            sched.step(loss)
        elif isinstance(sched, LR.LRScheduler):
            sched.step()
        out += [float(loss), float(opt.get_lr())]
    return out, {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in model.named_parameters()}


def one_process(run, form):
    """The same program in one process."""
    model = llama() if run.startswith("llama") else mlp()
    return train(model, FORMS[form](model), llama_loss if run.startswith("llama") else mlp_loss)


def _tp_fn(name, layer, mesh):
    if name == "fc1":
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(1)])
        layer.bias = ap.shard_tensor(layer.bias, mesh, [ap.Shard(0)])
    elif name == "fc2":
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(0)])


def distributed(run, form):
    if run == "llama_tp2":
        s = ap.Strategy()
        s.data_parallel.degree, s.tensor_parallel.degree = 1, 2
        model = llama()
        model, opt = ap.parallelize(model, FORMS[form](model), strategy=s)
        return train(model, opt, llama_loss)
    if run == "dp2tp2_zero2":
        s = ap.Strategy()
        s.data_parallel.degree, s.tensor_parallel.degree = 2, 2
        s.sharding.enable, s.sharding.stage = True, 2
        model = mlp()
        model, opt = ap.parallelize(model, FORMS[form](model), strategy=s,
                                    tp_plan={"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()})
        return train(model, opt, mlp_loss)
    tp = run == "tp2"
    mesh = ap.ProcessMesh([0, 1], dim_names=["mp" if tp else "dp"])
    model = ap.shard_layer(mlp(), mesh, _tp_fn if tp else None)
    opt = FORMS[form](model)
    opt = ap.shard_optimizer(opt, None if tp else ap.ShardingStage2("dp", mesh))
    place = [ap.Replicate()] if tp else [ap.Shard(0)]
    return train(model, opt, lambda m, s: mlp_loss(m, s, lambda t: ap.shard_tensor(t, mesh, place)))


RUNS2 = ["tp2", "zero2", "llama_tp2"]
RUNS4 = ["dp2tp2_zero2"]


def main():
    import paddle.distributed as dist

    from autoparallel.testing.launch import write_result

    out_dir = sys.argv[1]
    dist.init_parallel_env()
    rank = dist.get_rank()
    done = {}
    for run in (RUNS4 if sys.argv[2:] == ["four"] else RUNS2):
        for form in FORMS:
            try:
                losses, params = distributed(run, form)
            except Exception as e:                   # reported per form; the other forms still run
                done[f"{run}-{form}"] = f"{type(e).__name__}: {e}"
                continue
            done[f"{run}-{form}"] = "ok"
            if rank == 0:
                np.savez(os.path.join(out_dir, f"{run}-{form}.npz"), losses=np.array(losses),
                         **{"p:" + n: v for n, v in params.items()})
    write_result({"rank": rank, "done": done})


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
