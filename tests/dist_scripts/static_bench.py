"""Runs on every rank of a 4-rank gloo job: eager dispatch vs completed plans (ap.to_static) on the benchmark
graphs, and the MLP-Mixer under full auto mode next to pure data and pure tensor parallelism.

    static_bench.py OUT_JSON_DIR [--steps 20] [--cases mlp_input,attention_weights,residual_branch,mixer]

Per case and mode: the collectives one training step sends (count_comm around forward, backward and the
optimizer step, after one warm-up step), the median step time, and the losses (eager and completed runs
start from the same initialisation, so they must agree).
"""
import argparse
import statistics
import time

import numpy as np
import paddle
import paddle.distributed as dist


import autoparallel as ap  # noqa: E402
from autoparallel.comm.counter import count_comm  # noqa: E402
from autoparallel.graph.to_static import to_static  # noqa: E402
from autoparallel.planner.calibrate import cpu_profile  # noqa: E402
from autoparallel.spec import DistSpec  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402
from dist_scripts.static_models import MLP, AttentionBlock, Mixer, ResidualMLP, mse, xent  # noqa: E402

R, S = ap.Replicate(), ap.Shard
CPU = cpu_profile(20e9, 10e9, 8e9, 4)      # the fixed CPU/gloo profile completion prices plans with
LR = 0.05


def case_specs(name):
    """(model builder, mesh, input layouts, batch shapes and dtypes, annotations, loss)."""
    rng = np.random.default_rng(0)
    if name == "mlp_input":
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["data"])
        shapes = [((16, 64), "float32"), ((16, 64), "float32")]
        return lambda: MLP(64, 1024), mesh, [[S(0)], [S(0)]], shapes, {}, mse, rng
    if name == "attention_weights":
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["model"])
        shapes = [((8, 16, 64), "float32"), ((8, 16, 64), "float32")]
        ann = {"qkv.weight": [S(1)], "proj.weight": [S(0)]}
        return lambda: AttentionBlock(64, 4), mesh, [[R], [R]], shapes, ann, mse, rng
    if name == "residual_branch":
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["model"])
        shapes = [((16, 64), "float32"), ((16, 16), "float32")]
        return lambda: ResidualMLP(64, 256, 16), mesh, [[R], [R]], shapes, {"fc1.weight": [S(1)]}, mse, rng
    raise ValueError(name)


def data(shapes, rng, n):
    out = []
    for _ in range(n):
        out.append(tuple(rng.standard_normal(s).astype(d) if d.startswith("float") else
                         rng.integers(0, 10, s).astype(d) for s, d in shapes))
    return out


def eager_model(build, mesh, ann):
    paddle.seed(0)
    model = build()

    def shard_fn(name, sub, m):
        for pname in list(sub._parameters):
            full = f"{name}.{pname}" if name else pname
            if full in ann:
                setattr(sub, pname, ap.shard_tensor(getattr(sub, pname), m, ann[full]))

    model = ap.shard_layer(model, mesh, shard_fn=shard_fn)
    opt = ap.shard_optimizer(paddle.optimizer.SGD(LR, parameters=model.parameters()))
    return model, opt


def measure(step, batches):
    step(batches[0])                                       # warm-up
    with count_comm() as log:
        loss = step(batches[1])
    calls = {}
    for name, b, _ in log.calls:
        n, tot = calls.get(name, (0, 0.0))
        calls[name] = (n + 1, tot + b)
    times, losses = [], [loss]
    for b in batches[2:]:
        t0 = time.perf_counter()
        losses.append(step(b))
        times.append(time.perf_counter() - t0)
    return {"bytes": log.bytes_sent, "calls": calls, "step_s": statistics.median(times), "losses": losses}


def run_case(name, steps):
    build, mesh, layouts, shapes, ann, loss_fn, rng = case_specs(name)
    batches = data(shapes, rng, steps + 2)
    model, opt = eager_model(build, mesh, ann)

    def eager_step(batch):
        xs = [ap.shard_tensor(paddle.to_tensor(a), mesh, pl) for a, pl in zip(batch, layouts)]
        loss = loss_fn(model(*xs[:-1]), xs[-1])
        loss.backward()
        opt.step()
        opt.clear_grad()
        return float(loss)

    eager = measure(eager_step, batches)
    paddle.seed(0)
    smodel = build()
    specs = [DistSpec(mesh, pl, s, d) for pl, (s, d) in zip(layouts, shapes)]
    t0 = time.perf_counter()
    dm = to_static(smodel, None, loss_fn, paddle.optimizer.SGD(LR, parameters=smodel.parameters()),
                   input_spec=specs, mesh=mesh, annotations=ann, cluster=CPU)
    capture_s = time.perf_counter() - t0
    static = measure(dm.train_step, batches)
    return {"eager": eager, "static": static, "capture_s": capture_s, "listing": dm.listing(),
            "planned": dm.plan.collective_counts(), "cost_ms": dm.plan.cost * 1e3,
            "greedy_cost_ms": dm.plan.greedy_cost * 1e3}


# ---- MLP-Mixer: full auto mode vs pure DP vs pure TP ----------------------------------------------------
MIXER = dict(patches=16, patch_dim=48, channels=128, token_hidden=64, channel_hidden=512, depth=2, classes=10)
MIXER_BATCH = 32


def mixer_batches(n):
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((MIXER_BATCH, 16, 48)).astype("float32"),
             rng.integers(0, 10, (MIXER_BATCH,)).astype("int64")) for _ in range(n)]


def mixer_tp_annotations(model):
    ann = {}
    for name, _ in model.named_parameters():
        layer, leaf = name.rsplit(".", 1)
        if layer.endswith(("token1", "chan1")):
            ann[name] = [S(1)] if leaf == "weight" else [S(0)]
        elif layer.endswith(("token2", "chan2")) and leaf == "weight":
            ann[name] = [S(0)]
    return ann


def run_mixer(steps):
    batches = mixer_batches(steps + 2)
    out = {}
    for mode in ("dp", "tp"):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["data" if mode == "dp" else "model"])
        probe = Mixer(**MIXER)
        ann = mixer_tp_annotations(probe) if mode == "tp" else {}
        layouts = [[S(0)], [S(0)]] if mode == "dp" else [[R], [R]]
        model, opt = eager_model(lambda: Mixer(**MIXER), mesh, ann)

        def step(batch, model=model, opt=opt, mesh=mesh, layouts=layouts):
            xs = [ap.shard_tensor(paddle.to_tensor(a), mesh, pl) for a, pl in zip(batch, layouts)]
            loss = xent(model(xs[0]), xs[1])
            loss.backward()
            opt.step()
            opt.clear_grad()
            return float(loss)

        out[f"eager_{mode}"] = measure(step, batches)
    paddle.seed(0)
    model = Mixer(**MIXER)
    s = ap.Strategy()
    s.auto_mode = "full"
    t0 = time.perf_counter()
    dm = to_static(model, None, xent, paddle.optimizer.SGD(LR, parameters=model.parameters()), s,
                   input_spec=[([MIXER_BATCH, 16, 48], "float32"), ([MIXER_BATCH], "int64")], cluster=CPU)
    out["capture_s"] = time.perf_counter() - t0
    out["full"] = measure(dm.train_step, batches)
    out["listing"] = dm.listing()
    out["mesh"] = dm.mesh.shape
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cases", default="mlp_input,attention_weights,residual_branch,mixer")
    args = p.parse_args()
    dist.init_parallel_env()
    result = {}
    for name in args.cases.split(","):
        result[name] = run_mixer(args.steps) if name == "mixer" else run_case(name, args.steps)
    write_result(result)


if __name__ == "__main__":
    main()
