"""Shared helpers for reshard tests in the simulated world."""
import numpy as np
import paddle

import autoparallel as ap
from autoparallel.spec import DistSpec
from autoparallel.testing.check import assemble, expected_local


def run_sim_reshard(shape, mesh, src, dst, seed=0, check_grad=True):
    """Reshard a random tensor in the simulated world; return (value_ok, grad_ok, negative_ok)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype("float32")
    w = rng.standard_normal(shape).astype("float32")
    with ap.simulate(world_size=max(mesh.process_ids) + 1):
        dt = ap.shard_tensor(paddle.to_tensor(x), mesh, src, stop_gradient=not check_grad)
        y = ap.reshard(dt, mesh, dst)
        value_ok = np.allclose(assemble(y.locals, y.spec), x, rtol=1e-5, atol=1e-6)
        neg = None
        if not any(p.is_partial() for p in y.spec.placements):
            for r, t in y.locals.items():
                c = mesh.coords_of(r)
                if not np.allclose(t.numpy(), expected_local(x, y.spec, c), rtol=1e-5, atol=1e-6):
                    value_ok = False
            # negative control: a flipped shard order must be detected whenever shards differ
            flipped = all(t.shape == list(expected_local(x, y.spec, mesh.coords_of(r), flip=True).shape)
                          and np.allclose(t.numpy(), expected_local(x, y.spec, mesh.coords_of(r), flip=True))
                          for r, t in y.locals.items())
            neg = not flipped
        grad_ok = None
        if check_grad:
            rep = ap.reshard(y, mesh, [ap.Replicate()] * mesh.ndim)
            wt = paddle.to_tensor(w)
            losses = {r: (t * wt).sum() for r, t in rep.locals.items()}
            ap.DistTensor(losses, DistSpec(mesh, [ap.Replicate()] * mesh.ndim, ())).backward()
            gspec = dt.spec.with_placements([ap.Replicate() if p.is_partial() else p for p in dt.spec.placements])
            grad_ok = _grads_ok(dt, gspec, w, mesh)
    return bool(value_ok), grad_ok, neg


def _grads_ok(dt, gspec, w, mesh):
    """Per-term gradient convention: P(sum) terms get the true gradient, P(avg) terms 1/n of it, and
    P(max)/P(min) terms split it (their sum over the group is the true gradient)."""
    pl = dt.spec.placements
    scale = 1.0
    for i, p in enumerate(pl):
        if p.is_partial() and p.reduce_type == "avg":
            scale /= mesh.shape[i]
    split_dims = [i for i, p in enumerate(pl) if p.is_partial() and p.reduce_type in ("max", "min")]
    sums = {}
    for r, t in dt.locals.items():
        c = list(mesh.coords_of(r))
        for i in split_dims:
            c[i] = 0
        key = tuple(c)
        sums[key] = sums.get(key, 0) + t.grad.numpy().astype("float64")
    return all(np.allclose(v, expected_local(w, gspec, k) * scale, rtol=1e-5, atol=1e-5) for k, v in sums.items())
