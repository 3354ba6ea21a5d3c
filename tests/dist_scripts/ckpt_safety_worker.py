"""Checkpoint data safety on every rank of a real gloo job (2 ranks): a save that fails on one rank (an
injected full disk) is refused on every rank and leaves no partial directory; a second run on the same root
and a root that is a file are refused on every rank with the same typed error; resuming continues the run.
Usage: ckpt_safety_worker.py ROOT"""
import os
import sys


import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel.checkpoint import CheckpointManager, load_merged_state_dict  # noqa: E402
from autoparallel.testing.launch import attempt, write_result  # noqa: E402


def state(value: float) -> dict:
    mesh = ap.ProcessMesh([0, 1], ["dp"])
    w = ap.shard_tensor(paddle.full([4, 2], value), mesh, [ap.Shard(0)])
    return {"w": w, "loader": {"index": int(value)}}


def main(root: str) -> None:
    dist.init_parallel_env()
    rank = dist.get_rank()
    out = {}
    mgr = CheckpointManager(root, save_interval_steps=1)
    out["start"] = attempt(lambda: mgr.start(state(1.0)))
    out["save1"] = attempt(lambda: mgr.save(state(1.0), 1))
    os.environ.update(AP_CKPT_FAULT="shard_half_written:enospc", AP_CKPT_FAULT_RANK="1")
    out["save2_disk_full"] = attempt(lambda: mgr.save(state(2.0), 2))
    del os.environ["AP_CKPT_FAULT"], os.environ["AP_CKPT_FAULT_RANK"]
    dist.barrier()
    out["after_failure"] = sorted(os.listdir(root))
    dist.barrier()              # every rank has listed the root before any starts the next call (whose write probe,
    #                             .autoparallel-probe-r<rank>-<pid>, another rank's listing would otherwise catch)
    out["second_run"] = attempt(lambda: CheckpointManager(root).start(state(9.0)))
    afile = os.path.join(os.path.dirname(root), "a-file")
    if rank == 0:
        with open(afile, "w") as f:
            f.write("mine")
    dist.barrier()
    out["root_is_file"] = attempt(lambda: CheckpointManager(afile).start(state(9.0)))
    resumed = CheckpointManager(root, save_interval_steps=1)
    target = state(0.0)
    info = resumed.start(target, resume=True)
    out["resumed_step"] = info.step
    out["resumed_index"] = target["loader"]["index"]
    out["save2"] = attempt(lambda: resumed.save(state(2.0), 2))
    dist.barrier()
    out["final"] = sorted(os.listdir(root))
    out["latest"] = open(os.path.join(root, "latest")).read().strip()
    out["merged_w"] = load_merged_state_dict(root)["w"].tolist()
    write_result(out)


if __name__ == "__main__":
    main(sys.argv[1])
