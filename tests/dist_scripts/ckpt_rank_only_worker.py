"""Failures on some ranks only, on every rank of a real gloo job (2 ranks): rank 0's 'latest' write failing
after a manager save, rank 0's metadata write failing (an injected full disk), rank 0 failing after the commit's
rename, rank 1's load failing (its state does not match); then a save, a load and a collective that succeed (the job goes on).
Usage: ckpt_rank_only_worker.py ROOT"""
import errno
import os
import sys
import time

import numpy as np
import paddle
import paddle.distributed as dist

import autoparallel as ap
import autoparallel.checkpoint.run_root as run_root_module
from autoparallel.checkpoint import CheckpointManager
from autoparallel.testing.launch import write_result


def state(value: float, rows: int = 4) -> dict:
    mesh = ap.ProcessMesh([0, 1], ["dp"])
    w = ap.shard_tensor(paddle.full([rows, 2], value), mesh, [ap.Shard(0)])
    return {"w": w, "loader": {"index": int(value)}}


def attempt(fn) -> dict:
    """{"outcome": "ok" or "<type>: <message>", "seconds": wall time}: the test checks the outcome."""
    start = time.monotonic()
    try:
        fn()
        outcome = "ok"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    return {"outcome": outcome, "seconds": round(time.monotonic() - start, 2)}


def local_w(s: dict) -> list:
    return s["w"].local.numpy().tolist()


def main(root: str) -> None:
    dist.init_parallel_env()
    rank = dist.get_rank()
    out = {}
    mgr = CheckpointManager(root, save_interval_steps=1, keep_last=1)
    out["save1"] = attempt(lambda: mgr.save(state(1.0), 1))

    real_latest = run_root_module.write_latest
    if rank == 0:                               # rank 0's disk is full for the pointer
        def full(root_dir):
            raise OSError(errno.ENOSPC, "No space left on device")
        run_root_module.write_latest = full
    out["latest_fails_on_rank0"] = attempt(lambda: mgr.save(state(2.0), 2))
    run_root_module.write_latest = real_latest
    dist.barrier()
    out["after_latest_failure"] = sorted(os.listdir(root))
    out["latest"] = open(os.path.join(root, "latest")).read().strip()
    dist.barrier()

    one = os.path.join(os.path.dirname(root), "one")
    out["one_saved"] = attempt(lambda: ap.save_state_dict(state(5.0), one))
    os.environ.update(AP_CKPT_FAULT="before_metadata_rename:enospc", AP_CKPT_FAULT_RANK="0")
    out["metadata_fails_on_rank0"] = attempt(lambda: ap.save_state_dict(state(6.0), one, overwrite=True))
    del os.environ["AP_CKPT_FAULT"], os.environ["AP_CKPT_FAULT_RANK"]
    dist.barrier()
    kept = state(0.0)
    out["one_after"] = attempt(lambda: ap.load_state_dict(kept, one))
    out["one_after_w"] = local_w(kept)

    import autoparallel.checkpoint.save as save_module   # rank 0 cannot write its failure note either (full disk)
    real_note = save_module._note
    if rank == 0:
        save_module._note = lambda path, text: None
    os.environ.update(AP_CKPT_FAULT="before_metadata_rename:enospc", AP_CKPT_FAULT_RANK="0")
    out["note_fails_on_rank0"] = attempt(lambda: ap.save_state_dict(state(8.0), one, overwrite=True))
    del os.environ["AP_CKPT_FAULT"], os.environ["AP_CKPT_FAULT_RANK"]
    save_module._note = real_note
    dist.barrier()

    two = os.path.join(os.path.dirname(root), "two")      # rank 0 fails after the commit's rename (its fsync)
    os.environ.update(AP_CKPT_FAULT="after_dir_rename:enospc", AP_CKPT_FAULT_RANK="0")
    out["after_commit_fails_on_rank0"] = attempt(lambda: ap.save_state_dict(state(7.0), two))
    del os.environ["AP_CKPT_FAULT"], os.environ["AP_CKPT_FAULT_RANK"]
    y = paddle.to_tensor([float(rank + 1)])
    out["after_commit_collective"] = attempt(lambda: dist.all_reduce(y))   # nobody is left in a collective
    kept = state(0.0)
    out["two_loaded"] = attempt(lambda: ap.load_state_dict(kept, two))
    out["two_w"] = local_w(kept)

    target = state(0.0, rows=6 if rank == 1 else 4)       # rank 1's state does not match the checkpoint
    out["load_fails_on_rank1"] = attempt(lambda: ap.load_state_dict(target, os.path.join(root, "step-00000001")))
    out["load_fails_w"] = local_w(target)

    target = state(0.0)                                   # negative controls: the job goes on
    out["load_ok"] = attempt(lambda: ap.load_state_dict(target, os.path.join(root, "step-00000001")))
    out["load_ok_w"] = local_w(target)
    out["save3"] = attempt(lambda: mgr.save(state(3.0), 3))
    dist.barrier()                              # rank 0 removes the pruned directories after the save returns
    out["final"] = sorted(os.listdir(root))
    x = paddle.to_tensor([float(rank + 1)])
    dist.all_reduce(x)
    out["all_reduce"] = float(x.numpy()[0])
    write_result(out)


if __name__ == "__main__":
    main(sys.argv[1])
