"""Runs on every rank (4): this round's user forms of the simulated probes (tests/test_probe_loop_forms.py,
test_probe_inputs_loss.py, test_probe_layers_ops.py, test_zero_float64.py) on real gloo ranks: each form's
distributed run (dp2 x tp2 meshes, ZeRO-1/2/3, ap.parallelize over 4) against the one-process run computed on
the rank itself (losses / returned values, every final parameter). Reports {form: {"ok", "err"} or
{"error": traceback}}."""
import os
import sys

import numpy as np
import paddle
from paddle import nn

import autoparallel as ap
import test_probe_inputs_loss as CE
import test_probe_layers_ops as LO
import test_probe_loop_forms as L
import test_probe_static_forms as SF
import test_zero_float64 as F64
from autoparallel.parallel import grads, sharding
from autoparallel.testing.gpu_scaler import gpu_grad_scaler
from autoparallel.testing.launch import write_result
from forms_runner import run_all

world = ap.init_parallel_env()


def worst(a, b, rtol, atol) -> float:
    """Largest |a - b| / (atol + rtol |b|) (<= 1: equal within the tolerance; inf: other shapes)."""
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    if a.shape != b.shape:
        return float("inf")
    return float((np.abs(a - b) / (atol + rtol * np.abs(b))).max()) if a.size else 0.0


def compare(pairs, rtol, atol) -> float:
    return max(worst(a, b, rtol, atol) for a, b in pairs)


def scaler_unscale_clip(env):
    """GradScaler(1024): scale, backward, unscale_, clip_grad_norm_ by hand (its norm returned), step, update."""
    m = env.model()
    m, opt = env.wrap(m, paddle.optimizer.Momentum(0.05, parameters=m.parameters()))
    scaler, out = gpu_grad_scaler(init_loss_scaling=1024), []
    for s in range(3):
        loss = paddle.nn.functional.mse_loss(m(env.x(L.XS[s])), paddle.to_tensor(L.YS[s]))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        out.append(float(paddle.nn.utils.clip_grad_norm_(m.parameters(), 0.05)))
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
        out.append(float(loss))
    return out, L.params(m)


def loop_form(probe, run):
    want = probe(L.One())
    got = probe(L.RUNS[run]())
    pairs = [(got[0], want[0])] + [(got[1][n], v) for n, v in want[1].items()]
    return compare(pairs, 1e-4, 1e-4)


def cross_entropy(case, layout):
    y, kw, weight = CE.CASES[case]
    want = CE._one(y, kw, weight)
    dims, xpl, ypl = CE.LAYOUTS[layout]
    ypl = xpl if kw.get("soft_label") else ypl
    mesh = ap.ProcessMesh(np.arange(4).reshape([2, 2] if len(dims) == 2 else [4]).tolist(), dim_names=dims)
    x = ap.shard_tensor(paddle.to_tensor(CE.X, stop_gradient=False), mesh, xpl)
    w = ap.shard_tensor(paddle.to_tensor(CE.WEIGHT, stop_gradient=False), mesh, [CE.R] * len(dims)) if weight else None
    loss, scalar = CE._loss(x, ap.shard_tensor(paddle.to_tensor(y), mesh, ypl), w, kw)
    scalar.backward()
    got = (loss.full().numpy(), x.grad.full().numpy(), w.grad.full().numpy() if weight else None)
    pairs = [(got[0], want[0]), (got[1], want[1])] + ([(got[2], want[2])] if weight else [])
    return compare(pairs, 1e-4, 1e-6)


def batch_norm(split_stats):
    """test_probe_layers_ops' conv (output channels split over 4 ranks) then BatchNorm2D, one SGD step."""
    split, build = LO.channel_split(split_stats), LO.conv_bn
    x, loss_fn = LO._rand(4, 3, 5, 5) * 2 + 1, lambda y: (y ** 2).mean()
    paddle.seed(0)
    want = LO._step(build(), [x], loss_fn)
    paddle.seed(0)
    model = ap.shard_layer(build(), ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"]), split)
    got = LO._step(model, [x], loss_fn)
    assert not np.allclose(want[1]["1._mean"], 0)
    return compare([(got[0], want[0])] + [(got[1][n], v) for n, v in want[1].items()], 1e-4, 1e-5)


def zero_float64(stage, clip=None):
    want, got = F64.run(clip=clip), F64.run(stage, clip)
    bad = [n for n, p in got[1].items() if p.dtype != paddle.float64]
    if bad:
        raise AssertionError(f"not float64 after the ZeRO run: {bad}")
    return compare([(got[0], want[0])] + [(got[1][n].numpy(), v.numpy()) for n, v in want[1].items()], 1e-12, 1e-14)


LOOP = {                                                     # form: (probe, run of L.RUNS)
    "ParamAttr regularizer+lr / dp x tp": (L.param_attr, "dp x tp"),
    "param groups weight decay / parallelize dp": (L.groups_momentum, "parallelize dp"),
    "frozen after wrapping / zero1": (L.frozen_after_wrapping, "zero1"),
    "frozen mid-run / dp x tp": (L.frozen_mid_run, "dp x tp"),
    "unfrozen later / parallelize zero3": (L.unfrozen_later, "parallelize zero3"),
    "unused branch, clear_grad / zero2": (L.unused_branch, "zero2"),
    "model.clear_gradients accumulation / zero1": (L.model_clear_gradients, "zero1"),
    "two forwards one backward / zero3": (L.two_forwards, "zero3"),
    "ReduceOnPlateau(dist loss) / dp x tp": (L.plateau, "dp x tp"),
    "p.grad before first step / parallelize dp": (L.first_grads, "parallelize dp"),
    "p.grad before first step / parallelize zero1": (L.first_grads, "parallelize zero1"),
    "clip_grad_norm_ by hand / dp x tp": (L.hand_clip(L.CLIPS["norm"]), "dp x tp"),
    "clip_grad_value_ by hand / parallelize dp": (L.hand_clip(L.CLIPS["value"]), "parallelize dp"),
    "ClipGradByNorm / parallelize zero3": (L.zero_clip(lambda: nn.ClipGradByNorm(0.05)), "parallelize zero3"),
    "GradScaler.unscale_ + clip_grad_norm_ / dp x tp": (scaler_unscale_clip, "dp x tp"),
    "GradScaler.unscale_ + clip_grad_norm_ / parallelize dp": (scaler_unscale_clip, "parallelize dp"),
    "writes into params / zero2": (L.written, "zero2"),
    "writes into params / parallelize zero3": (L.written, "parallelize zero3"),
}

def static_zero3_round_trip(load=True):
    """test_probe_static_forms: a DistModel (to_static) under data parallel 4 + ZeRO-3 trains 2 steps, saves
    state_dict('all'); another DistModel (other seed) loads it and trains 2 more: the 4 losses are one process's."""
    batches = SF.mlp_batches(4)
    ref, _ = SF._reference(batches)
    s = SF._strategy("s.data_parallel.degree = 4; s.sharding.enable = True; s.sharding.stage = 3")
    dm = SF._dm(strategy=s)
    got = [float(dm(x, y)) for x, y in batches[:2]]
    path = os.path.join(sys.argv[1], f"zero3_all_{load}")
    ap.save_state_dict(dm.state_dict("all"), path)
    other = SF._dm(seed=1, strategy=s)
    if load:
        ap.load_state_dict(other.state_dict("all"), path)
    got += [float(other(x, y)) for x, y in batches[2:]]
    return compare([(got, ref)], 1e-5, 1e-6)


FORMS = {name: (lambda p=p, r=r: loop_form(p, r)) for name, (p, r) in LOOP.items()}
FORMS.update({
    "cross entropy -100, all-ignored shard, class weights / dp2 x vocab2":
        lambda: cross_entropy("ignore-100-mean-weight", "dp2xvocab2"),
    "cross entropy -100 / vocab4": lambda: cross_entropy("ignore-100-mean", "vocab4"),
    "cross entropy soft labels + weights / dp2 x vocab2": lambda: cross_entropy("soft-label-mean-weight", "dp2xvocab2"),
    "cross entropy label smoothing / seq2 x vocab2":
        lambda: cross_entropy("label-smoothing-mean-weight", "seq2xvocab2"),
    "BatchNorm stats replicated, conv channel split / 4": lambda: batch_norm(False),
    "BatchNorm stats channel split / 4": lambda: batch_norm(True),
    "float64 ZeRO-2 / dp2 x tp2": lambda: zero_float64(2),
    "float64 ZeRO-3 / 4": lambda: zero_float64(3),
    "float64 ZeRO-3 + ClipGradByGlobalNorm / 4": lambda: zero_float64(3, 0.05),
    "DistModel state_dict('all') save/load / dp4 ZeRO-3": static_zero3_round_trip,
})


def negative(obj, attr, value, fn):
    """``fn`` with ``obj.attr`` replaced by ``value`` (a fix undone): the check above must see the difference."""
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        return fn()
    finally:
        setattr(obj, attr, old)


NEGATIVE = {                                     # {control: err of the form with its fix undone} (expected > 1)
    "p.grad before first step, buckets not planned at backward": lambda: negative(
        grads.GradientSync, "before_backward", lambda self, ts=(): False,
        FORMS["p.grad before first step / parallelize dp"]),
    "float64 ZeRO-2 packed in float32": lambda: negative(
        sharding, "_master_dtype", lambda t: "float32", FORMS["float64 ZeRO-2 / dp2 x tp2"]),
    "DistModel continued without loading the checkpoint": lambda: static_zero3_round_trip(load=False),
}




def main():
    write_result({"rank": world.rank, "forms": run_all(FORMS), "negative": run_all(NEGATIVE)})


main()
