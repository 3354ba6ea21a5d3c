"""Loading through paddle's own calls on 2 real gloo ranks (tests/test_probe_ckpt8_dist.py):

* ``model.set_state_dict`` with one entry that fails only when written (a float64 value of the shard's shape or of
  the global shape for a float32 parameter, a distributed value of another global shape or dtype): every rank raises
  and no parameter changes; a float32 value of the shard's shape loads this rank's shard;
* ``paddle.distributed.load_merged_state_dict`` of a nested state saved with ``paddle.distributed.save_state_dict``:
  paddle's flat form on every rank, ``prefix`` honoured;
* ``paddle.distributed.save_state_dict`` over an earlier checkpoint failing in rank 1's write (an OSError raised
  there): both ranks raise, the earlier checkpoint still loads with its values.

Usage: ckpt8_worker.py ROOT
"""
import errno
import os
import sys
from unittest import mock

import numpy as np
import paddle
import paddle.distributed as pdist
from paddle import nn

import autoparallel as ap
from autoparallel.testing.launch import attempt, write_result


def model(mesh):
    paddle.seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    m[0].weight = ap.shard_tensor(m[0].weight, mesh, [ap.Shard(1)])        # local [4, 4]
    m[1].weight = ap.shard_tensor(m[1].weight, mesh, [ap.Shard(0)])        # local [4, 4]
    m[1].bias = ap.shard_tensor(m[1].bias, mesh, [ap.Replicate()])
    return m


def full(m) -> dict:
    return {k: v.numpy() for k, v in ap.full_state_dict(m).items()}     # collective: both ranks in step


def set_state_dict_cases(mesh, rank) -> dict:
    m = model(mesh)
    before = full(m)
    good = {k: np.full(v.shape, 7.0, "float32") for k, v in before.items()}    # global shapes; "0.bias" plain
    cases = {"shard_float64": ("0.weight", np.zeros([4, 4], "float64")),
             "global_float64": ("1.bias", np.zeros([4], "float64")),
             "dist_wrong_shape": ("1.weight", ap.shard_tensor(paddle.zeros([8, 6]), mesh, [ap.Shard(0)])),
             "dist_float16": ("1.weight", ap.shard_tensor(paddle.zeros([8, 4], "float16"), mesh, [ap.Shard(0)]))}
    out = {}
    for name, (key, value) in cases.items():
        out[name] = attempt(lambda: m.set_state_dict(dict(good, **{key: value})))
        after = full(m)
        out[name + "_changed"] = sorted(k for k in before if not np.array_equal(after[k], before[k]))
    shard = np.full([4, 4], float(rank + 1), "float32")          # each rank's own shard of "0.weight"
    out["shard_float32"] = attempt(lambda: m.set_state_dict({"0.weight": shard}))
    w = full(m)["0.weight"]
    out["shard_float32_value"] = bool(np.array_equal(w[:, :4], np.full([4, 4], 1.0))
                                      and np.array_equal(w[:, 4:], np.full([4, 4], 2.0)))
    return out


def merged_cases(mesh, root) -> dict:
    w = paddle.arange(12, dtype="float32").reshape([4, 3])
    state = {"model": {"fc.weight": ap.shard_tensor(w, mesh, [ap.Shard(0)])}, "opt": {"m": paddle.ones([3])}}
    path = os.path.join(root, "nested")
    pdist.save_state_dict(state, path)
    out = {}

    def merged():
        got = pdist.load_merged_state_dict(path)
        out["merged"] = {k: [type(v).__name__, np.asarray(v).tolist() if hasattr(v, "shape") else None]
                         for k, v in got.items()}

    out["merged_call"] = attempt(merged)
    out["merged_prefix_call"] = attempt(lambda: out.update(merged_prefix=sorted(
        pdist.load_merged_state_dict(path, prefix="model"))))
    return out


def failed_save_cases(mesh, rank, root) -> dict:
    from autoparallel.checkpoint import save

    path = os.path.join(root, "kept")
    old = {"w": ap.shard_tensor(paddle.full([4, 2], 1.0), mesh, [ap.Shard(0)])}
    pdist.save_state_dict(old, path)
    new = {"w": ap.shard_tensor(paddle.full([4, 2], 2.0), mesh, [ap.Shard(0)])}

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device (injected on rank 1)")
    patch = mock.patch.object(save, "write_rank_file", full_disk) if rank == 1 else mock.patch.dict({})
    with patch:
        out = {"failed_save": attempt(lambda: pdist.save_state_dict(new, path))}
    pdist.barrier()
    back = {"w": ap.shard_tensor(paddle.zeros([4, 2]), mesh, [ap.Shard(0)])}
    out["failed_save_load"] = attempt(lambda: pdist.load_state_dict(back, path))
    out["failed_save_kept"] = back["w"].full().numpy().tolist()
    out["failed_save_entries"] = sorted(os.listdir(root))
    return out


def main(root: str) -> None:
    pdist.init_parallel_env()
    rank = pdist.get_rank()
    mesh = ap.ProcessMesh([0, 1], ["x"])
    os.makedirs(root, exist_ok=True)
    out = {}
    out.update(set_state_dict_cases(mesh, rank))
    out.update(merged_cases(mesh, root))
    out.update(failed_save_cases(mesh, rank, root))
    write_result(out)


if __name__ == "__main__":
    main(sys.argv[1])
