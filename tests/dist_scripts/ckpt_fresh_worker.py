"""Checkpoint saves on 2 real gloo ranks whose path is not one directory for both, and a Ctrl-C inside a save.

Each rank works in a directory of its own (``<base>/node<r>``, its working directory): a relative path, and
``/proc/self/cwd/...`` (the same text on both ranks, a different directory on each, as ``/tmp`` on each node of a
job is), used to leave every rank polling for the other's files until AP_CKPT_TIMEOUT (an hour); reshard_state
through such a scratch directory too. Then, in a
directory both share: the same save succeeds (the negative control), and a KeyboardInterrupt raised in rank 1's
write of an overwrite fails the save on both ranks and keeps the checkpoint it was replacing; last, a resume
from node-local roots holding different saves under one path is refused.
Usage: ckpt_fresh_worker.py BASE"""
import os
import sys
import time

import paddle
import paddle.distributed as dist

import autoparallel as ap
import autoparallel.checkpoint.save as save_module
from autoparallel.checkpoint import CheckpointManager, load_merged_state_dict
from autoparallel.testing.launch import write_result


def attempt(fn) -> list:
    """[outcome, seconds]: "ok" or "<type>: <message>" of what ``fn`` raised (KeyboardInterrupt included)."""
    start = time.monotonic()
    try:
        fn()
        outcome = "ok"
    except BaseException as e:          # noqa: BLE001  (reported by type and message; the test checks them)
        outcome = f"{type(e).__name__}: {e}"
    return [outcome, time.monotonic() - start]


def listing(path: str) -> list:
    """Every entry under ``path``, relative, sorted (hidden files included)."""
    out = []
    for root, dirs, files in os.walk(path):
        out += [os.path.relpath(os.path.join(root, n), path) for n in dirs + files]
    return sorted(out)


def interrupted_write(rank: int):
    """save.py's writer, raising KeyboardInterrupt in rank 1's write (a Ctrl-C reaching that rank mid-save)."""
    real = save_module.write_rank_file

    def write(directory, r, items, block_bytes):
        if rank == 1:
            raise KeyboardInterrupt()
        return real(directory, r, items, block_bytes)
    return real, write


def node_local_resume(rank: int, own: str, shared: str, state) -> dict:
    """Each rank's own root (``/proc/self/cwd/run2``) holds a step-1 checkpoint of another save (rank 0: w = 1,
    rank 1: w = 3), as node-local roots left by earlier runs can: restore() used to load each rank's own, the
    ranks then holding different values of one tensor, silently."""
    import shutil

    ap.save_state_dict(state(3.0), os.path.join(shared, "ck3"), step=1)
    source = os.path.join(shared, "ck" if rank == 0 else "ck3")
    shutil.copytree(source, os.path.join(own, "run2", "step-00000001"))
    target = state(0.0)
    os.chdir(own)
    got = {"node_local_restore": attempt(lambda: CheckpointManager("/proc/self/cwd/run2").restore(target))}
    os.chdir(shared)
    got["node_local_restore_w"] = target["w"]._local_value().numpy().tolist()
    return got


def main(base: str) -> None:
    dist.init_parallel_env()
    rank = dist.get_rank()
    mesh = ap.ProcessMesh([0, 1], ["dp"])

    def state(v: float) -> dict:
        return {"w": ap.shard_tensor(paddle.full([4, 2], v), mesh, [ap.Shard(0)]), "loader": {"index": int(v)}}

    own = os.path.join(base, f"node{rank}")
    os.makedirs(own, exist_ok=True)
    os.chdir(own)
    out = {}
    out["relative"] = attempt(lambda: ap.save_state_dict(state(1.0), "ck-relative"))
    out["node_local"] = attempt(lambda: ap.save_state_dict(state(1.0), "/proc/self/cwd/ck-node-local"))
    out["manager_node_local"] = attempt(lambda: CheckpointManager("/proc/self/cwd/run").start(state(1.0)))
    dist.barrier()
    from autoparallel.checkpoint import reshard_state

    out["reshard_node_local"] = attempt(lambda: reshard_state(state(1.0), state(0.0), tmp_dir="/proc/self/cwd"))
    dist.barrier()
    out["own_listing"] = listing(own)
    shared = os.path.join(base, "shared")
    os.makedirs(shared, exist_ok=True)
    os.chdir(shared)
    dist.barrier()
    out["shared_relative"] = attempt(lambda: ap.save_state_dict(state(1.0), "ck", step=1))
    mgr = CheckpointManager(os.path.join(shared, "run"), save_interval_steps=1)
    out["shared_manager"] = attempt(lambda: (mgr.start(state(1.0)), mgr.save(state(1.0), 1)))
    real, write = interrupted_write(rank)
    save_module.write_rank_file = write
    out["interrupted_overwrite"] = attempt(lambda: ap.save_state_dict(state(2.0), "ck", step=2, overwrite=True))
    save_module.write_rank_file = real
    dist.barrier()
    out["shared_listing"] = listing(shared)
    out.update(node_local_resume(rank, own, shared, state))
    merged = load_merged_state_dict(os.path.join(shared, "ck"))
    out["after_interrupt"] = {"w": merged["w"].tolist(), "loader": merged["loader"]}
    target = state(0.0)
    out["loaded_step"] = ap.load_state_dict(target, os.path.join(shared, "ck")).step
    out["loaded_local"] = target["w"]._local_value().numpy().tolist() if hasattr(target["w"], "_local_value") \
        else None
    write_result(out)


if __name__ == "__main__":
    main(sys.argv[1])
