"""Runs on 2 ranks: the user's own paddle.distributed collectives next to the library's.

* ``dist.all_reduce`` of a replicated DistTensor (a loss) every step of a data-parallel run, beside the run's own
  gradient reductions (both noted in the collective log: no false mismatch may end the run);
* ``dist.broadcast`` of a replicated DistParameter after rank 1 changed its copy (a user syncing weights by hand);
* ``dist.broadcast`` / ``dist.all_reduce`` of a tensor-parallel DistParameter: refused on every rank, shards unchanged.
* ``dist.broadcast_object_list`` written on two lines by rank; then ``ap.save_state_dict`` compares the ranks'
  collective logs (the user's calls are noted in them): they must agree.
Usage: launch_forms_worker.py OUT_DIR
"""
import os
import sys

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
        try:                                                  # the DDP habit on the loss itself: refused (it is
            dist.all_reduce(loss.detach())                    # already the global batch's on every rank)
            refused = False
        except TypeError as e:
            refused = "already the whole global batch" in str(e)
        metric = paddle.to_tensor(value)                      # a plain tensor: paddle's own collective
        dist.all_reduce(metric)                               # the DDP habit: sum, then divide by the world
        out.append([value, float(metric) / dist.get_world_size(), float(refused)])
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


def object_from_rank0(rank):
    """One collective written on two lines, by rank (legal): the collective log must not take it for a mismatch."""
    if rank == 0:
        got = [{"lr": 0.1}]
        dist.broadcast_object_list(got, src=0)
    else:
        got = [None]
        dist.broadcast_object_list(got, src=0)
    dist.barrier()                                            # every rank: noted alike
    return got[0]


def logs_agree(out_dir):
    """ap.save_state_dict compares every rank's collective log first (a mismatch raises on every rank)."""
    layer = ap.shard_layer(paddle.nn.Linear(2, 2), ap.ProcessMesh([0, 1], ["x"]))
    ap.save_state_dict(layer.state_dict(), os.path.join(out_dir, "ckpt"))
    return True


def main():
    dist.init_parallel_env()
    rank = dist.get_rank()
    out = {"dp": dp_with_metric(), "broadcast_replicated": broadcast_replicated(rank), "sharded": sharded_refused()}
    out["object"] = object_from_rank0(rank)                   # after the library's first tensor: noted
    out["logs_agree"] = logs_agree(sys.argv[1])
    write_result(out)


if __name__ == "__main__":
    main()
