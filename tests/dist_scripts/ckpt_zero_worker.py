"""Every rank runs a list of training jobs of the example (in order, one process) and reports, per job,
its per-step losses and, with "check", how the loaded state matches the merged checkpoint it came from.

argv: a JSON file [{"name", "argv": [example flags], "check": checkpoint dir or null, "copy": [[src, dst]]}].
A job with "check" is meant to train no step (--steps = the checkpoint's step): its state is the loaded
one. "copy": directories rank 0 copies before the job (an earlier job's checkpoints), then a barrier."""
import json
import shutil
import sys
import time
import traceback


from ckpt_zero_common import mismatches, tensor_names  # noqa: E402

import paddle.distributed as dist  # noqa: E402
import train_common  # noqa: E402
import autoparallel as ap  # noqa: E402
from autoparallel.checkpoint import load_merged_state_dict, load_state_dict, training_state  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402


def run(job) -> dict:
    if job.get("copy"):
        if dist.get_rank() == 0:
            for src, dst in job["copy"]:
                shutil.copytree(src, dst)
        dist.barrier()
    args = train_common.make_parser("gpt-tiny").parse_args(job["argv"])
    log, model, opt = train_common.train(args)
    out = {"losses": [[s["step"], s["loss"]] for s in log["steps"]]}
    if job.get("check"):
        state = training_state(model, opt)
        out["bad"], out["boxes"] = mismatches(state, load_merged_state_dict(job["check"], flat=True))
        out["names"] = tensor_names(state)
        out["bytes_read"] = load_state_dict(state, job["check"]).bytes_read      # the same values again
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    train_common.init_distributed()
    # the whole world's group first: paddle 3.3.1's gloo may fail to create it after smaller groups exist
    ap.ProcessMesh(list(range(dist.get_world_size())), ["data"])
    results = {}
    for job in jobs:
        try:
            t0 = time.perf_counter()
            results[job["name"]] = run(job)
            results[job["name"]]["seconds"] = time.perf_counter() - t0
        except Exception:
            results[job["name"]] = {"error": traceback.format_exc()}
            break                                # later jobs may depend on this one's checkpoint
    write_result(results)
