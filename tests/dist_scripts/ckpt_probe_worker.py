"""Checkpoint saves whose ranks' states differ, on 2 real gloo ranks: Partial entries in another order or one
rank lacking one (gloo would pair one entry's reduction with another's) and a sharded entry one rank does not
pass, or a JSON value that differs between the ranks (only one would be stored), are refused on both ranks
before anything is committed; the same save with agreeing states stores the reduced values. Usage: ckpt_probe_worker.py ROOT"""
import os
import shutil
import sys
import time

import paddle
import paddle.distributed as dist

import autoparallel as ap
from autoparallel.checkpoint import load_merged_state_dict, save_state_dict
from autoparallel.testing.launch import attempt, write_result


def main(root: str) -> None:
    dist.init_parallel_env()
    rank = dist.get_rank()
    mesh = ap.ProcessMesh([0, 1], ["dp"])

    def part(v):                         # rank r holds v * (r + 1): the value is 3v
        return ap.dtensor_from_local(paddle.full([4], v * (rank + 1)), mesh, [ap.Partial()])

    def sharded(v):
        return ap.shard_tensor(paddle.full([4, 2], v), mesh, [ap.Shard(0)])

    cases = {
        "agree": {"a": part(1.0), "b": part(10.0), "loader": {"epoch": 2}},
        "value_differs": {"w": sharded(1.0), "loader": {"index": 64 * rank}},
        "swapped": {"a": part(1.0), "b": part(10.0)} if rank == 0 else {"b": part(10.0), "a": part(1.0)},
        "partial_missing": {"a": part(1.0), "b": part(10.0)} if rank == 0 else {"b": part(10.0)},
        "sharded_missing": {"w": sharded(1.0), "v": sharded(2.0)} if rank == 0 else {"w": sharded(1.0)},
    }
    out = {}
    for name, state in cases.items():
        start = time.monotonic()
        try:
            save_state_dict(state, os.path.join(root, name))
            out[name] = "ok"
        except Exception as e:          # reported by type and message; the test checks them
            out[name] = f"{type(e).__name__}: {e}"
        out[name + "_s"] = time.monotonic() - start
        dist.barrier()
    start = time.monotonic()
    out["bad_value_on_rank_1"] = attempt(lambda: save_state_dict(
        {"w": sharded(1.0), "note": object() if rank == 1 else "x"}, os.path.join(root, "bad_value")))
    out["bad_value_on_rank_1_s"] = time.monotonic() - start
    dist.barrier()
    start = time.monotonic()
    out["fails_after_exchange_on_rank_1"] = attempt(lambda: fail_in_collect(rank, os.path.join(root, "late"),
                                                                            {"w": sharded(1.0)}))
    out["fails_after_exchange_on_rank_1_s"] = time.monotonic() - start
    dist.barrier()
    out["entries"] = sorted(os.listdir(root))
    out["agree_values"] = {k: getattr(v, "tolist", lambda v=v: v)()
                           for k, v in load_merged_state_dict(os.path.join(root, "agree")).items()}
    out.update(resume_cases(os.path.join(os.path.dirname(root), "runs"), rank, sharded))
    from zero_sd_checks import zero_state_dict_cases

    out.update(zero_state_dict_cases(os.path.join(os.path.dirname(root), "zero_sd")))
    write_result(out)


def resume_cases(runs: str, rank: int, sharded) -> dict:
    """A resume that fails on one rank (its state has an entry the checkpoint lacks) fails on both; ranks that
    would resume from different checkpoints (roots that are not one shared directory) fail on both."""
    from autoparallel.checkpoint import CheckpointManager

    out = {}
    shared = CheckpointManager(os.path.join(runs, "shared"), save_interval_steps=1)
    shared.start({"w": sharded(1.0)})
    shared.save({"w": sharded(1.0)}, 1)
    target = {"w": sharded(0.0)} if rank == 0 else {"w": sharded(0.0), "extra": sharded(0.0)}
    out["resume_one_rank_fails"] = attempt(lambda: CheckpointManager(shared.dir).start(target, resume=True))
    own = CheckpointManager(os.path.join(runs, f"own{rank}"), save_interval_steps=1)
    shutil.copytree(shared.path_for(1), own.path_for(rank + 1))     # a root each rank sees alone
    dist.barrier()
    out["resume_different_roots"] = attempt(lambda: CheckpointManager(own.dir).restore({"w": sharded(0.0)}))
    return out


def fail_in_collect(rank: int, path: str, state: dict):
    """Rank 1 fails after the opening exchange, before writing (an internal error while collecting)."""
    from unittest import mock

    from autoparallel.checkpoint import save

    if rank != 1:
        return save_state_dict(state, path)

    def broken(*a, **k):
        raise RuntimeError("injected failure while collecting on rank 1")
    with mock.patch.object(save, "collect", broken):
        return save_state_dict(state, path)


if __name__ == "__main__":
    main(sys.argv[1])
