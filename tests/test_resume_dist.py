"""Checkpoint and resume of the training example on 4 real gloo ranks (one launch, dist_scripts/ckpt_zero_worker.py
running its jobs in order on the same ranks).

Exact resume: 20 steps with a checkpoint at step 10, against 5 steps, stop, resume, 15 more: identical losses
bit for bit. Cross-strategy: the DP2xTP2 checkpoint of step 5 loaded under DP4 (4 ranks) and in one process
continues with the original run's next-step losses. The resumed run starts in ranks that have just trained the
DP4 run (steps 5-7, other layouts and data): only what it loads from the checkpoint can make it continue the
5-step run exactly, nothing left in the process by that run.
"""
import json
import os
import pathlib

import pytest

from dist_scripts import shared_launch

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "dist_scripts", "ckpt_zero_worker.py")
COMMON = ["--seed", "0"]


def _jobs(root):
    root = pathlib.Path(root)
    a, b, c, d = (str(root / n) for n in "abcd")
    jobs = [
        {"name": "first", "argv": ["--dp", "2", "--tp", "2", "--steps", "5", "--ckpt-dir", b, "--save-every", "5"]},
        {"name": "dp4", "argv": ["--dp", "4", "--steps", "8", "--ckpt-dir", c, "--save-every", "100", "--resume"],
         "copy": [[b, c], [b, d]]},
        {"name": "resumed", "argv": ["--dp", "2", "--tp", "2", "--steps", "20", "--ckpt-dir", b, "--save-every", "5",
                                     "--resume"]},
        {"name": "full", "argv": ["--dp", "2", "--tp", "2", "--steps", "20", "--ckpt-dir", a, "--save-every", "10"]},
    ]
    for job in jobs:
        job["argv"] += COMMON
    path = root / "jobs.json"
    path.write_text(json.dumps(jobs))
    return [path]


JOB = shared_launch.job(__name__, "resume", WORKER, 4, args=_jobs, timeout=600)


def _losses(pairs):
    return {step: loss for step, loss in pairs}


@pytest.fixture(scope="module")
def runs():
    root, ranks = shared_launch.results(JOB)
    for r, res in enumerate(ranks):
        for name, job in res.items():
            assert "error" not in job, f"rank {r} job {name}:\n{job['error']}"
    import train_common

    d = os.path.join(root, "d")
    args = train_common.make_parser("gpt-tiny").parse_args(["--steps", "8", "--ckpt-dir", d, "--save-every", "100",
                                                            "--resume", *COMMON])
    log, _, _ = train_common.train(args)
    single = [[s["step"], s["loss"]] for s in log["steps"]]
    got = {name: _losses(ranks[0][name]["losses"]) for name in ("full", "first", "resumed", "dp4")}
    return {**got, "single": _losses(single),
            "ranks": [[res[name]["losses"] for res in ranks] for name in ("full", "resumed")]}


def test_resume_is_exact_bit_for_bit(runs):
    stitched = {**runs["first"], **runs["resumed"]}
    assert sorted(stitched) == list(range(20)) and min(runs["resumed"]) == 5
    assert stitched == runs["full"]                       # exact float equality at every step


def test_every_rank_reports_the_same_losses(runs):
    for results in runs["ranks"]:
        assert all(r == results[0] for r in results)


@pytest.mark.parametrize("which", ["dp4", "single"])
def test_checkpoint_loads_under_another_strategy_and_training_continues(runs, which):
    got = runs[which]
    assert sorted(got) == [5, 6, 7]
    for step, loss in got.items():
        assert loss == pytest.approx(runs["full"][step], rel=1e-5, abs=1e-6)


def test_negative_control_a_fresh_start_differs_from_the_resumed_run(runs):
    assert runs["full"][0] != pytest.approx(runs["full"][5], rel=1e-5)
