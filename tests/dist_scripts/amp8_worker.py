"""Runs on each rank (2) of a gloo job (tests/test_probe_amp8_dist.py): paddle.amp.GradScaler over a ZeRO optimizer
(``dist.shard_optimizer`` stage 1/2/3 over a data-parallel mesh) where the second rank's half of step 1's batch
overflows, in two forms:

* ``div``: ``(scaler.scale(loss) / 2).backward()``, a backward from a tensor computed from the scaled loss;
* ``warmup``: one step without the scaler (``loss.backward(); opt.step()``), then the scaler's steps.

Each rank reports, per stage and form, the losses, the scales and the final parameters (or the error raised).

Usage: amp8_worker.py
"""
import warnings

import paddle
import paddle.distributed as pdist
import paddle.nn.functional as F

import autoparallel as ap
from autoparallel.testing.gpu_scaler import gpu_grad_scaler
from autoparallel.testing.launch import write_result
from test_probe_api_optimizers import MLP
from test_probe_precision_scaler import DATA

STAGES = {"zero1": ap.ShardingStage1, "zero2": ap.ShardingStage2, "zero3": ap.ShardingStage3}


def loop(m, opt, to_input, form):
    """3 GradScaler steps (after one unscaled step for ``warmup``); returns losses, scales and the parameters."""
    scaler = gpu_grad_scaler(init_loss_scaling=2.0**15, incr_every_n_steps=2)
    losses, scales = [], []
    for i, (x, y) in enumerate(([DATA[0]] if form == "warmup" else []) + DATA):
        with paddle.amp.auto_cast(dtype="float16"):
            loss = F.mse_loss(m(to_input(x)), paddle.to_tensor(y))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if form == "warmup" and i == 0:
                loss.backward()
                opt.step()
            else:
                scaled = scaler.scale(loss)
                (scaled / 2 if form == "div" else scaled).backward()
                scaler.step(opt)
                scaler.update()
        opt.clear_grad()
        losses.append(float(loss))
        scales.append(float(scaler._scale))
    values = {n: (p.full() if ap.is_dist(p) else p).numpy().tolist() for n, p in m.named_parameters()}
    return {"losses": losses, "scales": scales, "params": values}


def one_process(form) -> dict:
    paddle.seed(3)
    m = MLP()
    return loop(m, paddle.optimizer.AdamW(0.05, parameters=m.parameters()), paddle.to_tensor, form)


def distributed(stage, form) -> dict:
    mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
    paddle.seed(3)
    m = ap.shard_layer(MLP(), mesh)
    opt = ap.shard_optimizer(paddle.optimizer.AdamW(0.05, parameters=m.parameters()), STAGES[stage]("dp", mesh))
    return loop(m, opt, lambda x: ap.shard_tensor(paddle.to_tensor(x), mesh, [ap.Shard(0)]), form)


def main() -> None:
    pdist.init_parallel_env()
    out = {"rank": pdist.get_rank()}
    for stage in STAGES:
        for form in ("div", "warmup"):
            try:
                out[f"{stage}/{form}"] = distributed(stage, form)
            except Exception as e:          # reported by type and message; the test shows it
                out[f"{stage}/{form}"] = f"{type(e).__name__}: {e}"
    write_result(out)


if __name__ == "__main__":
    main()
