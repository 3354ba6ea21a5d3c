"""examples/article_program.py on 4 launched gloo ranks (one job of the shared 4-rank launch,
tests/dist_scripts/article_program_worker.py): PP2 x TP2 with sequence parallel, accumulation, recompute and bf16
autocast; PP2 x DP2 with accumulation, fp16 autocast + GradScaler and a tied head; DP2 x TP2 with sequence
parallel, recompute and the monitor; and a PP2 x TP2 run killed after a checkpoint and resumed. Every step's loss
equals the same program on one process."""
import os
import sys

import numpy as np
import pytest

from autoparallel import auto_checkpoint
from dist_scripts import shared_launch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "dist_scripts"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import article_program as program  # noqa: E402
import article_program_worker as worker  # noqa: E402

JOB = shared_launch.job(__name__, "article_program", os.path.join(HERE, "dist_scripts", "article_program_worker.py"),
                        4, args=lambda out: [out], timeout=300)
DEGREES = {"--dp", "--tp", "--pp", "--micro-batches"}


def one_process_flags(flags):
    """The same flags without the parallel degrees (one process has one rank)."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f in DEGREES:
            skip = True
        elif f != "--sp":
            out.append(f)
    return out


def one_process(flags):
    auto_checkpoint.reset()
    try:
        return worker.losses(program.main(one_process_flags(flags) + worker.STEPS))
    finally:
        auto_checkpoint.reset()


@pytest.mark.parametrize("name", sorted(worker.CONFIGS))
def test_every_step_equals_one_process(name):
    _, ranks = shared_launch.results(JOB)
    expected = one_process(worker.CONFIGS[name])
    for r, got in enumerate(ranks):
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, err_msg=f"rank {r}, {name}")


def test_resume_after_kill_equals_the_uninterrupted_run():
    _, ranks = shared_launch.results(JOB)
    whole = one_process([f for f in worker.KILLED if f not in ("--save-every", "1")])
    assert len(whole) == 4
    for r, got in enumerate(ranks):
        np.testing.assert_allclose(got["resumed"], whole[2:], rtol=1e-5, err_msg=f"rank {r}")
