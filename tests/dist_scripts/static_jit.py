"""Runs on 2 gloo ranks: can paddle.jit.to_static compile the per-rank local computation of a completed plan?

    static_jit.py

Tries, on this platform (CPU, gloo, paddle 3.3.1), and reports for each: ok / the exception, the maximum
difference from eager, and per-call times.
  1. the local computation of one rank of a column- then row-parallel MLP (plain paddle ops on shards),
     AST mode (full_graph=True) and SOT mode (full_graph=False), forward and backward;
  2. the same with the row-parallel all_reduce (paddle.distributed.all_reduce) inside the function;
  3. the completed plan's forward through dispatch (DistTensor inputs, pinned layouts).
"""
import time
import traceback

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F


import autoparallel as ap  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402


def local_mlp(x, w1, b1, w2):
    return paddle.matmul(F.gelu(paddle.matmul(x, w1) + b1), w2)


def local_mlp_reduced(x, w1, b1, w2):
    y = paddle.matmul(F.gelu(paddle.matmul(x, w1) + b1), w2)
    dist.all_reduce(y)
    return y


def _message(e):
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: " + " | ".join(lines[-2:])[:400]


def per_call(fn, args, n=50):
    fn(*args)
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*args)
    return (time.perf_counter() - t0) / n


def attempt(name, fn, args, ref):
    try:
        out = fn(*args)
        out.sum().backward()
        diff = float(np.abs(out.numpy() - ref.numpy()).max())
        return {"case": name, "ok": True, "max_diff": diff, "per_call_s": per_call(fn, args)}
    except Exception as e:                              # report exactly how it fails
        return {"case": name, "ok": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}",
                "where": traceback.format_exc().strip().splitlines()[-3][:200]}


def main():
    dist.init_parallel_env()
    rank = dist.get_rank()
    rng = np.random.default_rng(rank)
    x = paddle.to_tensor(rng.standard_normal((16, 64)).astype("float32"))
    ws = [paddle.to_tensor(rng.standard_normal(s).astype("float32") * 0.1) for s in ((64, 128), (128,), (128, 64))]
    for w in ws:
        w.stop_gradient = False
    out = []
    eager = local_mlp(x, *ws)
    out.append({"case": "eager local computation", "ok": True, "max_diff": 0.0,
                "per_call_s": per_call(local_mlp, (x, *ws))})
    for full in (True, False):
        mode = "AST full_graph=True" if full else "SOT full_graph=False"
        out.append(attempt(f"local computation, {mode}", paddle.jit.to_static(local_mlp, full_graph=full),
                           (x, *ws), eager))
    ref = local_mlp_reduced(x, *ws)
    for full in (True, False):
        mode = "AST full_graph=True" if full else "SOT full_graph=False"
        out.append(attempt(f"local computation + dist.all_reduce, {mode}",
                           paddle.jit.to_static(local_mlp_reduced, full_graph=full), (x, *ws), ref))
    out.extend(dispatch_case())
    write_result(out)


def dispatch_case():
    from autoparallel.graph.to_static import to_static
    from dist_scripts.static_models import MLP, mse

    mesh = ap.ProcessMesh([0, 1], dim_names=["model"])
    paddle.seed(0)
    model = MLP(16, 64)
    dm = to_static(model, None, mse, None, input_spec=[([8, 16], "float32"), ([8, 16], "float32")], mesh=mesh,
                   annotations={"fc1.weight": [ap.Shard(1)]})
    x = paddle.randn([8, 16])
    want = dm.predict(x).full().numpy()

    def forward(t):
        return dm.predict(t).full()

    out = []
    for full in (True, False):
        case = f"completed plan forward through dispatch, {'AST full_graph=True' if full else 'SOT full_graph=False'}"
        try:
            y = paddle.jit.to_static(forward, full_graph=full)(x)
            out.append({"case": case, "ok": True, "max_diff": float(np.abs(y.numpy() - want).max())})
        except Exception as e:
            frames = [ln.strip() for ln in traceback.format_exc().splitlines() if ln.strip().startswith("File")]
            out.append({"case": case, "ok": False, "error": _message(e),
                        "where": [f[:160] for f in frames[-3:]]})
    return out


if __name__ == "__main__":
    main()
