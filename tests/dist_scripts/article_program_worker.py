"""4 gloo ranks: examples/article_program.py's main() for several configurations in one launch, each rank
recording every step's loss; one configuration is killed after a checkpoint and resumed from it.

argv: the output directory (checkpoints go under it)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))

import article_program as program                          # noqa: E402
from autoparallel import auto_checkpoint                    # noqa: E402
from autoparallel.testing.launch import write_result       # noqa: E402

STEPS = ["--steps", "4"]
CONFIGS = {                                                 # name -> flags (the test runs each on one process)
    "pp2_tp2_sp_accum2_recompute_bf16_tied": ["--pp", "2", "--tp", "2", "--sp", "--accum", "2", "--recompute",
                                              "--amp", "bf16", "--tied"],
    "pp2_dp2_accum2_fp16": ["--pp", "2", "--dp", "2", "--accum", "2", "--amp", "fp16"],
    "dp2_tp2_sp_recompute_monitor_ckpt": ["--dp", "2", "--tp", "2", "--sp", "--recompute", "--monitor",
                                     "--imbalance-threshold", "0"],
}
KILLED = ["--pp", "2", "--tp", "2", "--sp", "--accum", "2", "--save-every", "1"]


def losses(log):
    return [s["loss"] for s in log["steps"]]


def main(out):
    got = {}
    for name, flags in CONFIGS.items():      # "ckpt": automatic saves every 2 steps (after the monitor's re-plan too)
        ckpt = ["--ckpt-dir", os.path.join(out, name)] if name.endswith("ckpt") else []
        got[name] = losses(program.main(flags + ckpt + STEPS))
        auto_checkpoint.reset()
    ckpt = ["--ckpt-dir", os.path.join(out, "ckpt")]
    try:
        program.main(KILLED + ckpt + STEPS + ["--kill-after", "2"])
        raise AssertionError("--kill-after 2 did not stop the run")
    except program.Killed:
        pass
    auto_checkpoint.reset()                                 # the process a restart starts anew
    got["resumed"] = losses(program.main(KILLED + ckpt + STEPS + ["--resume"]))
    write_result(got)


if __name__ == "__main__":
    main(sys.argv[1])
