"""Every rank runs the training example with the given flags and reports its per-step losses."""
import sys


import train_common  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402

if __name__ == "__main__":
    args = train_common.make_parser("gpt-tiny").parse_args(sys.argv[1:])
    log, _, _ = train_common.train(args)
    write_result([[s["step"], s["loss"]] for s in log["steps"]])
