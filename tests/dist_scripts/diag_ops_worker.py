"""Runs on 4 ranks: every call of the diagonal / window / scatter tables (tests/test_probe_fresh_diag_ops.py) and of
the scatter / count / statistics table (tests/test_probe_fresh_value_ops.py) with its inputs laid out over real gloo
ranks (split along dim 0 and dim 1: uneven shards, 6 and 5 rows over 4 ranks leave a rank none; Partial; on a 2 x 2
mesh two dims split), forward
and backward under the tables' output weighting. Each rank reports the gathered value and input gradients; the test
compares them with one process (tests/test_diag_ops_dist.py)."""
import os
import sys

import numpy as np
import paddle

import autoparallel as ap
from autoparallel.testing.launch import write_result

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))      # tests/: the tables

KINDS = ("S0", "S1", "P", "S0,Slast")      # layout kinds of tests/layout_sweep_helpers.py (the mesh shape is its
                                           # LAYOUTS entry: 4, or 2 x 2); the simulated tables run them all


def tables() -> dict:
    import test_probe_fresh_diag_ops as D
    import test_probe_fresh_value_ops as V

    return {**{f"diag/{k}": v for k, v in D.CASES.items()}, **{f"value/{k}": v for k, v in V.CASES.items()}}


def _full(t):
    return t.full().numpy() if hasattr(t, "full") else t.numpy()


def run(fn, xs, kind, mesh):
    from layout_sweep_helpers import placements

    ins = [ap.shard_tensor(paddle.to_tensor(a, stop_gradient=False), mesh, placements(kind, a.ndim)) for a in xs]
    out = fn(*ins)
    weight = np.random.default_rng(9).standard_normal(out.shape).astype("float32")     # the tables' weighting
    (out * paddle.to_tensor(weight)).sum().backward()
    grads = [_full(t.grad) if t.grad is not None else np.zeros_like(a) for t, a in zip(ins, xs)]
    return {"value": _full(out).tolist(), "grads": [g.tolist() for g in grads]}


def main():
    from layout_sweep_helpers import LAYOUTS

    meshes = {k: ap.ProcessMesh(np.arange(4).reshape(LAYOUTS[k]).tolist(), dim_names=["a", "b"][:len(LAYOUTS[k])])
              for k in KINDS}
    out = {}
    for name, (fn, xs, _) in tables().items():          # the same order on every rank: collectives pair up
        for kind in KINDS:
            mesh = meshes[kind]
            print("case", name, kind, flush=True)           # the last one named in a rank's log is where it stopped
            try:
                out[f"{name}@{kind}"] = run(fn, xs, kind, mesh)
            except Exception as e:          # reported per case: one failure does not hide the others
                out[f"{name}@{kind}"] = f"{type(e).__name__}: {e}"[:400]
                print("failed", name, kind, out[f"{name}@{kind}"], flush=True)
    write_result(out)


if __name__ == "__main__":
    ap.init_parallel_env()
    main()
