"""One rank of tools/bench/predict.py: trains the GPT example under several strategies, in rounds.

    _bench_predict_worker.py OUT_DIR JOBS_JSON ROUNDS [FIRST_ROUND]
    JOBS_JSON: [{"name": ..., "argv": [examples/train_gpt.py flags]}, ...]

Round r runs every job once, odd rounds in reverse order (so a slow spell or a drift of the shared
machine's load falls on all of them alike); rank 0's example log of job j in round r is
OUT_DIR/<j>_r<r>.json. Every rank reports that it finished.
"""
import json
import os
import sys

import paddle
import paddle.distributed as dist


from examples import train_common  # noqa: E402

from autoparallel.comm.groups import install_group_store_fix  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402


def main():
    out_dir, jobs, rounds = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    first = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    dist.init_parallel_env()
    install_group_store_fix()
    done = []
    for r in range(first, first + rounds):
        for job in (jobs if r % 2 == 0 else jobs[::-1]):
            log_path = os.path.join(out_dir, f"{job['name']}_r{r}.json")
            args = train_common.make_parser("gpt-tiny").parse_args(job["argv"] + ["--log-json", log_path])
            train_common.train(args)
            done.append(f"{job['name']}_r{r}")
    write_result({"rank": dist.get_rank(), "done": done})


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
