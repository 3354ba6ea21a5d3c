"""Shared helpers of the op tables run over layouts: each call on plain tensors (values and every input's gradient
under a random output weighting) against the same call with its inputs laid out on a 4-rank mesh (split along
each dim: uneven shards, Partial) or a 2 x 2 mesh (two dims split, a dim split twice, Partial beside a split)."""
import numpy as np
import paddle

import autoparallel as ap

LAYOUTS = {"S0": [4], "S1": [4], "S2": [4], "P": [4], "S0,Slast": [2, 2], "P,S0": [2, 2], "Slast,P": [2, 2],
           "S0,S0": [2, 2]}        # layout kind: mesh shape


def x(*shape, seed=0):
    """A float32 standard-normal array of ``shape`` (seeded by the shape, so each shape's values are fixed)."""
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype("float32")


def placements(kind, ndim):
    """One input's placements for a layout kind (a dim past the input's rank stays R)."""
    if kind in ("S0", "S1", "S2"):
        return [ap.Shard(int(kind[1]))] if int(kind[1]) < ndim else [ap.Replicate()]
    if kind == "P":
        return [ap.Partial()]
    last = max(ndim - 1, 0)
    two = {"S0,Slast": [ap.Shard(0), ap.Shard(last)], "P,S0": [ap.Partial(), ap.Shard(0)],
           "Slast,P": [ap.Shard(last), ap.Partial()], "S0,S0": [ap.Shard(0), ap.Shard(0)]}
    return two[kind]


def _full(t):
    return t.full().numpy() if hasattr(t, "full") else t.numpy()


def _grads(ins, xs):
    return [_full(t.grad) if t.grad is not None else np.zeros_like(a) for t, a in zip(ins, xs)]


def reference(fn, xs):
    ins = [paddle.to_tensor(a, stop_gradient=False) for a in xs]
    out = fn(*ins)
    weight = np.random.default_rng(9).standard_normal(out.shape).astype("float32")
    (out * paddle.to_tensor(weight)).sum().backward()
    return out.numpy(), weight, _grads(ins, xs)


def distributed(fn, xs, weight, kind):
    shape = LAYOUTS[kind]
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh(np.arange(4).reshape(shape).tolist(), dim_names=["a", "b"][:len(shape)])
        ins = [ap.shard_tensor(paddle.to_tensor(a, stop_gradient=False), mesh, placements(kind, a.ndim)) for a in xs]
        out = fn(*ins)
        (out * paddle.to_tensor(weight)).sum().backward()
        return _full(out), _grads(ins, xs)


def failures(cases, kind) -> list:
    """'name value' / 'name grad i' of every case ``name: (f, arrays, reference f or None)`` that differs."""
    out = []
    for name, (fn, xs, ref) in cases.items():
        want, weight, want_grads = reference(ref or fn, xs)
        got, grads = distributed(fn, xs, weight, kind)
        pairs = [("value", got, want)] + [(f"grad {i}", a, b) for i, (a, b) in enumerate(zip(grads, want_grads))]
        out += [f"{name} {what}" for what, g, w in pairs
                if g.shape != w.shape or not np.allclose(g, w, rtol=1e-4, atol=1e-5)]
    return out
