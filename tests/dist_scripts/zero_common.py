"""The tiny GPT, its batches and the single-process AdamW run shared by the ZeRO tests and worker."""
import dataclasses
import os

import numpy as np
import paddle

from autoparallel.testing.models import fit, parameters_np
from examples.models import PRESETS, build

STEPS = 6


def tiny():
    paddle.seed(0)
    return build(dataclasses.replace(PRESETS["gpt-tiny"], vocab_size=256))


def batches(n=STEPS):
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 256, (8, 16)), rng.integers(0, 256, (8, 16))) for _ in range(n)]


def make_opt(model, clip=None):
    gc = paddle.nn.ClipGradByGlobalNorm(clip) if clip else None
    return paddle.optimizer.AdamW(3e-3, parameters=model.parameters(), grad_clip=gc)


def reference(clip=None, steps=STEPS):
    m = tiny()
    opt = make_opt(m, clip)
    return fit(m, opt, batches(steps)), parameters_np(m)


def matches(name, run, ref):
    """(losses equal on every rank?, final parameters equal?) of config ``name`` of a worker ``run`` (output
    folder, rank results) against ``ref`` (losses, {name: parameter})."""
    out, ranks = run
    ok_loss = all(np.allclose(r["configs"][name]["losses"], ref[0], rtol=1e-4, atol=1e-6) for r in ranks)
    params = np.load(os.path.join(out, name + ".npz"))
    ok_params = all(np.allclose(params[n], v, rtol=1e-4, atol=5e-5) for n, v in ref[1].items())
    return ok_loss, ok_params


def assert_matches(name, run, ref):
    """Config ``name`` trained like the single-process ``ref``: its losses on every rank, its final parameters."""
    ok_loss, ok_params = matches(name, run, ref)
    got = run[1][0]["configs"][name]["losses"]
    assert ok_loss, f"{name}: losses {np.round(got, 5).tolist()} vs {np.round(ref[0], 5).tolist()}"
    assert ok_params, f"{name}: final parameters differ from the single-process run"
