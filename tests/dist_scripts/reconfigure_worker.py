"""4 gloo ranks: train, ap.reconfigure to another strategy (default rebuild), train on; one job per entry."""
import json
import sys


import numpy as np                                         # noqa: E402
import paddle                                              # noqa: E402
import paddle.distributed as dist                          # noqa: E402
import paddle.nn.functional as F                           # noqa: E402

import autoparallel as ap                                  # noqa: E402
from autoparallel import layer_state  # noqa: E402
from autoparallel.testing.launch import run_jobs, write_result  # noqa: E402
from zero_common import batches, make_opt, tiny           # noqa: E402


def strategy(d: dict) -> ap.Strategy:
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = d.get("dp"), d.get("tp", 1)
    if d.get("zero"):
        s.sharding.enable, s.sharding.stage = True, d["zero"]
    return s


def run(job: dict) -> dict:
    model = tiny()
    model, opt = ap.parallelize(model, make_opt(model), strategy(job["before"]))
    losses = []
    for i, (x, y) in enumerate(batches(job["steps"])):
        if i == job["switch_at"]:
            model, opt = ap.reconfigure(model, opt, strategy(job["after"]))
        loss = F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    params = {}
    if getattr(opt, "stage", None) == 3:                   # ZeRO-3 holds chunks: gather the weights to read them
        opt.gather(list(model.parameters()))
    for n, p in model.named_parameters():
        params[n] = (p.as_dist().full() if hasattr(p, "as_dist") else p).numpy().tolist()
    return {"losses": losses, "params": params, "mesh": layer_state.mesh_of(model).mesh.tolist()}


def main():
    dist.init_parallel_env()
    write_result({"rank": dist.get_rank(), "jobs": run_jobs(run, json.loads(sys.argv[1]))})


if __name__ == "__main__":
    np.set_printoptions(precision=6)
    main()
