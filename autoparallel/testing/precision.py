"""A model of only the ops paddle has bfloat16 CPU kernels for (multiply, subtract, sum and their gradients), for
tests of low-precision parameters, master weights and their checkpoints on a CPU machine."""
from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

BATCHES = [np.random.default_rng(i).standard_normal((8, 4)).astype("float32") for i in range(3)]


class Scale(nn.Layer):
    """loss = sum((x * w - b)^2)."""

    def __init__(self, init=None):
        super().__init__()
        const = None if init is None else nn.initializer.Constant(init)
        self.w = self.create_parameter([8, 4], default_initializer=const)
        self.b = self.create_parameter([4], is_bias=True)

    def forward(self, x):
        h = x * self.w - self.b
        return (h * h).sum()


def low_model(seed: int = 2, dtype: str = "bfloat16") -> Scale:
    paddle.seed(seed)
    m = Scale()
    m.to(dtype=dtype)
    return m


def full_values(m) -> dict:
    """{name: float32 ndarray} of every parameter (a distributed one gathered)."""
    from autoparallel.dist_tensor import is_dist

    return {n: (p.full() if is_dist(p) else p).astype("float32").numpy() for n, p in m.named_parameters()}
