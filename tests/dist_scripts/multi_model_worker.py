"""Runs on 2 ranks: several models in one program on real gloo ranks (tests/test_probe_multi_model_dist.py).

* a GAN whose generator and discriminator sit on different meshes over the same two ranks (DP [2, 1] and TP
  [1, 2]), with a gradient penalty: the generator's output crosses to the discriminator's mesh rank-locally and
  its gradient comes back;
* negative control: the generator step fed a detached output (no gradient reaches the generator);
* an EMA copy made by copy.deepcopy of a tensor-parallel and of a ZeRO-3 model; a parameter shared by a teacher and a student;
* two models on the sub-meshes [0] and [1], every rank calling backward: the gradient crosses back to rank 0
  (before: a typed error there; the values are checked in test_cross_mesh_grad_dist.py).
Each reports losses and full parameter values (lists) for comparison with one process."""

import paddle
import paddle.distributed as dist

import autoparallel as ap
from autoparallel.testing.launch import write_result
from test_probe_multi_model_values import MLP, Z, distill, ema_run, gan


def plain(run):
    losses, *models = run
    return {"losses": losses, "models": [{k: v.tolist() for k, v in m.items()} for m in models]}


def main():
    dist.init_parallel_env()
    out = {"gan dp/tp": plain(gan("dp", "tp")), "gan tp/dp": plain(gan("tp", "dp"))}
    out["gan detached (control)"] = plain(gan("dp", "tp", detach=True))
    for mode in ("tp", "zero3"):
        evals, m, ema, *_ = ema_run(mode, "after")
        out[f"ema {mode}"] = {"losses": [e.tolist() for e in evals], "models": [{k: v.tolist() for k, v in d.items()}
                                                                               for d in (m, ema)]}
    losses, student, teacher, _, tied = distill("dp", "dp")
    out["distill shared dp"] = {"losses": losses, "models": [{k: v.tolist() for k, v in d.items()}
                                                            for d in (student, teacher)], "tied": tied}
    out["sub-meshes backward"] = sub_meshes()
    write_result(out)


def sub_meshes():
    """A on rank 0, B on rank 1, B(ap.reshard(A(x))), backward on both ranks: each holds its model's gradient."""
    A, B = MLP(4, 8, 6), MLP(6, 8, 1)
    m0, m1 = ap.ProcessMesh([0], dim_names=["x"]), ap.ProcessMesh([1], dim_names=["x"])
    A, B = ap.shard_layer(A, m0), ap.shard_layer(B, m1)
    loss = B(ap.reshard(A(paddle.to_tensor(Z[0])), m1, [ap.Replicate()])).mean()
    try:
        loss.backward()
    except NotImplementedError as e:
        return {"error": type(e).__name__, "text": str(e)}
    mine = A if dist.get_rank() == 0 else B
    return {"error": None, "grad": mine.fc1.weight.grad is not None}


if __name__ == "__main__":
    main()
