"""Runs on 4 ranks: layers on meshes of different ranks, activations moved by ap.reshard, every rank calling
loss.backward() (tests/test_cross_mesh_grad_dist.py). Each case of tests/cross_mesh_cases.py trains two steps;
each rank reports the losses of the meshes it is in and the parameters it holds, for comparison with one
process. Also: the moves detached (the only form that ran before: a negative control), meshes sharing some
ranks (refused on every rank before any message), and paddle.grad through a move (refused)."""
import os

import paddle
import paddle.distributed as dist

import autoparallel as ap
import cross_mesh_cases as C
from autoparallel.testing.launch import write_result


def main():
    dist.init_parallel_env()
    only = os.environ.get("AP_CROSS_MESH_CASES")        # a ";"-separated subset (debugging)
    out = {case: C.run(case, True) for case in C.CASES if not only or case in only.split(";")}
    out["mlp [0]/[1], paddle.autograd.backward"] = C.run("mlp [0]/[1]", True, functional=True)
    out["gan"] = C.run_gan(True)
    out["retain_graph"] = C.run_retained(True)
    out["mlp [0]/[1], moves detached (control)"] = C.run("mlp [0]/[1]", True, detach=True)
    out["meshes sharing a rank"] = refused(lambda h, m: ap.reshard(h, m, [ap.Replicate()]).mean().backward())
    out["paddle.grad"] = refused(lambda h, m: paddle.grad(ap.reshard(h, m, [ap.Replicate()]).mean(), [h]),
                                 dst=[2])
    write_result(out)


def refused(step, dst=(1, 2)):
    m0, m1 = ap.ProcessMesh([0, 1], dim_names=["x"]), ap.ProcessMesh(list(dst), dim_names=["x"])
    w = paddle.ones([2, 2])
    w.stop_gradient = False
    h = ap.shard_tensor(w, m0, [ap.Replicate()]) * 2.0
    try:
        step(h, m1)
    except NotImplementedError as e:
        return {"error": type(e).__name__, "text": str(e)}
    return {"error": None}


if __name__ == "__main__":
    main()
