"""The tiny GPT, its batches and the single-process AdamW run shared by the ZeRO tests and worker."""
import dataclasses

import numpy as np
import paddle
import paddle.nn.functional as F

from examples.models import PRESETS, build

STEPS = 12


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
    losses = []
    for x, y in batches(steps):
        loss = F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: p.numpy() for n, p in m.named_parameters()}
