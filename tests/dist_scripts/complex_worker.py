"""Runs on 2 gloo ranks: complex tensors through real collectives (gloo has no complex type; they travel as their
real views): as_complex of a row-split, a Partial and a (real, imag)-split tensor gathered whole; a complex
reshard S(0) -> S(1) (all-to-all); the complex rotary embedding of tests/test_complex_ops.py with its input split
along the heads, the sequence, or Partial, forward and backward. Each rank reports the gathered values."""
import os
import sys

import numpy as np
import paddle

import autoparallel as ap
from autoparallel.testing.launch import write_result

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))      # tests/

A = np.random.default_rng(0).standard_normal((4, 6, 2)).astype("float32")
X = np.random.default_rng(1).standard_normal((2, 6, 4, 4)).astype("float32")
W = np.random.default_rng(2).standard_normal((2, 6, 4, 4)).astype("float32")


def pair(c):
    return np.stack([c.real, c.imag], -1).tolist()


def main():
    from test_complex_ops import rope

    mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
    out = {}
    for name, p in (("S0", ap.Shard(0)), ("P", ap.Partial()), ("S2", ap.Shard(2))):
        c = paddle.as_complex(ap.shard_tensor(paddle.to_tensor(A), mesh, [p]))
        out[f"as_complex {name}"] = pair(c.numpy())
    c = paddle.as_complex(ap.shard_tensor(paddle.to_tensor(A), mesh, [ap.Shard(0)]))
    moved = ap.reshard(c, mesh, [ap.Shard(1)])
    out["reshard S0->S1"] = {"placements": str(moved.placements), "value": pair(moved.numpy())}
    for name, p in (("heads", ap.Shard(2)), ("seq", ap.Shard(1)), ("P", ap.Partial())):
        x = ap.shard_tensor(paddle.to_tensor(X, stop_gradient=False), mesh, [p])
        y = rope(x)
        (y * paddle.to_tensor(W)).sum().backward()
        out[f"rope {name}"] = {"value": y.numpy().tolist(), "grad": x.grad.numpy().tolist()}
    write_result(out)


if __name__ == "__main__":
    ap.init_parallel_env()
    main()
