"""Runs on 2 ranks: the user's own paddle.distributed collectives next to the library's.

* ``dist.all_reduce`` of a replicated DistTensor (a loss) every step of a data-parallel run, beside the run's own
  gradient reductions (both noted in the collective log: no false mismatch may end the run);
* ``dist.broadcast`` of a replicated DistParameter after rank 1 changed its copy (a user syncing weights by hand);
* ``dist.broadcast`` / ``dist.all_reduce`` of a tensor-parallel DistParameter: refused on every rank, shards unchanged.
Usage: launch_forms_worker.py
"""
import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

import autoparallel as ap
from autoparallel.testing.launch import write_result
from test_probe_rank_only_values import MLP

STEPS = 3


def batches():
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((8, 8)).astype("float32"), rng.integers(0, 4, (8,))) for _ in range(STEPS)]


def dp_with_metric():
    paddle.seed(0)
    m = MLP()
    opt = paddle.optimizer.SGD(0.1, parameters=m.parameters())
    s = ap.Strategy()
    s.data_parallel.degree = 2
    m, opt = ap.parallelize(m, opt, strategy=s)
    out = []
    for x, y in batches():
        with ap.parallel_guard(["data"]):
            loss = F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        value = float(loss)
        metric = loss.detach()                                # shares the loss's storage, as in paddle
        dist.all_reduce(metric)                               # the DDP habit: sum, then divide by the world
        out.append([value, float(metric) / dist.get_world_size()])
    return out


def broadcast_replicated(rank):
    paddle.seed(0)
    layer = ap.shard_layer(paddle.nn.Linear(4, 4), ap.ProcessMesh([0, 1], ["x"]))
    expect = layer.weight.numpy().copy()
    if rank == 1:
        layer.weight.set_value(paddle.zeros([4, 4]))
    dist.broadcast(layer.weight, src=0)
    return bool(np.array_equal(layer.weight.numpy(), expect))


def sharded_refused():
    paddle.seed(0)
    mesh = ap.ProcessMesh([0, 1], ["x"])

    def shard_fn(name, layer, m):
        if name == "":
            layer.weight = ap.shard_tensor(layer.weight, m, [ap.Shard(1)])
    layer = ap.shard_layer(paddle.nn.Linear(4, 4), mesh, shard_fn=shard_fn)
    before = layer.weight.numpy().copy()
    errors = []
    for call in (lambda: dist.broadcast(layer.weight, src=0), lambda: dist.all_reduce(layer.weight)):
        try:
            call()
            errors.append(None)
        except TypeError as e:
            errors.append(str(e)[:120])
    return {"errors": errors, "unchanged": bool(np.array_equal(layer.weight.numpy(), before)),
            "full": layer.weight.full().numpy().tolist()}


def main():
    dist.init_parallel_env()
    rank = dist.get_rank()
    write_result({"dp": dp_with_metric(), "broadcast_replicated": broadcast_replicated(rank),
                  "sharded": sharded_refused()})


if __name__ == "__main__":
    main()
