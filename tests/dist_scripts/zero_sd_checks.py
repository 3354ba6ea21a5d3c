"""paddle's optimizer state-dict forms of ZeRO on real ranks (run by ckpt_probe_worker.py on 2 gloo ranks): ZeRO-2
``opt.state_dict()`` -> ``paddle.distributed.save_state_dict`` -> ``load_state_dict`` into a fresh ZeRO-3 optimizer's
and a one-process optimizer's state dicts. fc1's weight [5, 8] has chunks ending inside rows (its state is gathered
over the ranks, a collective), the others' chunks are rows (views of the live chunks)."""
import os

import numpy as np
import paddle

import autoparallel as ap

RNG = np.random.default_rng(1)
XS = [RNG.standard_normal((4, 5)).astype("float32") for _ in range(6)]


def _build(mesh=None, stage=None):
    paddle.seed(7)
    m = paddle.nn.Sequential(paddle.nn.Linear(5, 8), paddle.nn.Tanh(), paddle.nn.Linear(8, 3))
    opt = paddle.optimizer.Adam(0.05, parameters=m.parameters())
    if mesh is None:
        return m, opt
    m = ap.shard_layer(m, mesh)
    return m, ap.shard_optimizer(opt, stage("dp", mesh))


def _steps(m, opt, mesh, idx):
    out = []
    for i in idx:
        x = paddle.to_tensor(XS[i])
        if mesh is not None:
            x = ap.shard_tensor(x, mesh, [ap.Shard(0)])
        loss = (m(x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        out.append(float(loss))
    return out


def _arrays(sd) -> dict:
    return {k: np.asarray(v).tolist() for k, v in sd.items() if k != "LR_Scheduler"}


def _diff(a: dict, b: dict) -> float:
    if sorted(a) != sorted(b):
        return float("inf")
    return max(float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max()) for k in a)


def zero_state_dict_cases(root: str) -> dict:
    mesh = ap.ProcessMesh([0, 1], ["dp"])
    path = os.path.join(root, "zero2_opt")
    out = {}
    with paddle.utils.unique_name.guard():
        m, opt = _build(mesh, ap.ShardingStage2)
        _steps(m, opt, mesh, range(2))
        sd = opt.state_dict()
        out["zero_sd_layouts"] = {k: [str(p) for p in v.placements] for k, v in sd.items() if ap.is_dist(v)}
        want = _arrays(ap.full_state_dict(opt))
        model = {k: v.numpy() for k, v in ap.full_state_dict(m).items()}
        paddle.distributed.save_state_dict(sd, path)
        out["zero_sd_want_losses"] = _steps(m, opt, mesh, range(2, 4))
    with paddle.utils.unique_name.guard():
        m3, o3 = _build(mesh, ap.ShardingStage3)
        _steps(m3, o3, mesh, range(4, 6))                   # other states, then the load in place
        paddle.distributed.load_state_dict(o3.state_dict(), path)
        out["zero_sd_into_zero3"] = _diff(_arrays(ap.full_state_dict(o3)), want)
        m3.set_state_dict(model)
        out["zero_sd_zero3_losses"] = _steps(m3, o3, mesh, range(2, 4))
    with paddle.utils.unique_name.guard():
        m1, o1 = _build()
        _steps(m1, o1, None, range(4, 5))
        sd1 = o1.state_dict()
        paddle.distributed.load_state_dict(sd1, path)
        o1.set_state_dict(sd1)
        out["zero_sd_into_one"] = _diff(_arrays(o1.state_dict()), want)
    return out
