"""Checkpoint and resume of the training example on 4 real gloo ranks.

Exact resume: 20 steps with a checkpoint at step 10, against 5 steps, stop, resume, 15 more: identical losses
bit for bit. Cross-strategy: the DP2xTP2 checkpoint of step 5 loaded under DP4 (4 ranks) and in one process
continues with the original run's next-step losses.
"""
import os
import shutil

import pytest

from autoparallel.testing.launch import launch

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "dist_scripts", "train_example_worker.py")
COMMON = ["--seed", "0"]


def _losses(results):
    return {step: loss for step, loss in results[0]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    a, b = str(root / "a"), str(root / "b")
    full = launch(WORKER, 4, ["--dp", "2", "--tp", "2", "--steps", "20", "--ckpt-dir", a, "--save-every", "10",
                              *COMMON])
    first = launch(WORKER, 4, ["--dp", "2", "--tp", "2", "--steps", "5", "--ckpt-dir", b, "--save-every", "5",
                               *COMMON])
    c, d = str(root / "c"), str(root / "d")
    shutil.copytree(b, c)
    shutil.copytree(b, d)
    resumed = launch(WORKER, 4, ["--dp", "2", "--tp", "2", "--steps", "20", "--ckpt-dir", b, "--save-every", "5",
                                 "--resume", *COMMON])
    dp4 = launch(WORKER, 4, ["--dp", "4", "--steps", "8", "--ckpt-dir", c, "--save-every", "100", "--resume",
                             *COMMON])
    import train_common

    args = train_common.make_parser("gpt-tiny").parse_args(["--steps", "8", "--ckpt-dir", d, "--save-every", "100",
                                                            "--resume", *COMMON])
    log, _, _ = train_common.train(args)
    single = [[[s["step"], s["loss"]] for s in log["steps"]]]
    return {"full": _losses(full), "first": _losses(first), "resumed": _losses(resumed), "dp4": _losses(dp4),
            "single": _losses(single), "ranks": [full, resumed]}


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
