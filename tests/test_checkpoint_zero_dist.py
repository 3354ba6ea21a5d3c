"""Cross-strategy checkpoints of the training example (gpt-tiny) on real gloo ranks: ZeRO and pipeline.

A DP2 x TP2 + ZeRO-2 run (4 ranks, 8 steps, checkpoints at 4 and 8) is the original. Its step-4
checkpoint loads under TP2 (2 ranks), DP4 + ZeRO-3 (4 ranks), PP2 x DP2 (4 ranks) and one process: every
box of every tensor each rank then holds (parameters and optimizer states) equals the merged checkpoint,
and the next two losses equal the original run's. Resuming ZeRO-2 at step 4 reproduces the original's
losses and its step-8 checkpoint bit for bit; resuming PP2 x DP2 continues the uninterrupted pipeline run,
and a pipeline checkpoint loads into one process. Every strategy's checkpoint
and state has the same entry names.
"""
import json
import os
import pathlib

import numpy as np
import pytest

from dist_scripts import shared_launch

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = os.path.join(HERE, "dist_scripts", "ckpt_zero_worker.py")
COMMON = ["--seed", "0"]
ZERO2 = ["--dp", "2", "--tp", "2", "--sharding-stage", "2"]
PP = ["--pp", "2", "--dp", "2", "--micro-batches", "2"]
STEP4 = "step-00000004"

from ckpt_zero_common import mismatches, tensor_names  # noqa: E402


def _losses(pairs):
    return {step: loss for step, loss in pairs}


def _train_here(argv):
    import train_common

    return train_common.train(train_common.make_parser("gpt-tiny").parse_args([str(a) for a in argv] + COMMON))


def _jobs(path, jobs):
    for job in jobs:
        job["argv"] = [str(a) for a in job["argv"]] + COMMON
    with open(path, "w") as f:
        json.dump(jobs, f)
    return path


COPIES = ("z3", "z2", "ppz", "tp2", "one")        # directories the step-4 checkpoint is copied to


def _four(root):
    root = pathlib.Path(root)
    step4 = str(root / "orig" / STEP4)
    copies = {name: root / name for name in COPIES}
    return [_jobs(root / "jobs4.json", [
        {"name": "orig", "argv": [*ZERO2, "--steps", "8", "--ckpt-dir", root / "orig", "--save-every", "4"]},
        {"name": "z3_check", "argv": ["--dp", "4", "--sharding-stage", "3", "--steps", "4", "--ckpt-dir",
                                      copies["z3"], "--resume"], "check": step4,
         "copy": [[step4, str(d / STEP4)] for d in copies.values()]},
        {"name": "z3", "argv": ["--dp", "4", "--sharding-stage", "3", "--steps", "6", "--ckpt-dir", copies["z3"],
                                "--resume", "--save-every", "6"]},
        {"name": "z2_resume", "argv": [*ZERO2, "--steps", "8", "--ckpt-dir", copies["z2"], "--resume",
                                       "--save-every", "4"]},
        {"name": "pp_check", "argv": [*PP, "--steps", "4", "--ckpt-dir", copies["ppz"], "--resume"],
         "check": step4},
        {"name": "pp_from_zero", "argv": [*PP, "--steps", "6", "--ckpt-dir", copies["ppz"], "--resume",
                                          "--save-every", "100"]},
        {"name": "pp_full", "argv": [*PP, "--steps", "6", "--ckpt-dir", root / "pp_full", "--save-every", "3"]},
        {"name": "pp_resume", "argv": [*PP, "--steps", "6", "--ckpt-dir", root / "pp", "--resume",
                                       "--save-every", "100"],
         "copy": [[str(root / "pp_full" / "step-00000003"), str(root / "pp" / "step-00000003")]]},
    ])]


def _two(out):
    """The 2-rank jobs resume from the copy the 4-rank launch made of its step-4 checkpoint."""
    root = pathlib.Path(shared_launch.results(FOUR)[0])
    copies = {name: root / name for name in COPIES}
    step4 = str(root / "orig" / STEP4)
    return [_jobs(pathlib.Path(out) / "jobs2.json", [
        {"name": "tp2_check", "argv": ["--tp", "2", "--steps", "4", "--ckpt-dir", copies["tp2"], "--resume"],
         "check": step4},
        {"name": "tp2", "argv": ["--tp", "2", "--steps", "6", "--ckpt-dir", copies["tp2"], "--resume",
                                 "--save-every", "6"]},
    ])]


FOUR = shared_launch.job(__name__, "ckpt_zero4", JOBS, 4, args=_four, timeout=600)
TWO = shared_launch.job(__name__, "ckpt_zero2", JOBS, 2, args=_two, timeout=600, after=[FOUR])


@pytest.fixture(scope="module")
def runs():
    out, four = shared_launch.results(FOUR)
    _, two = shared_launch.results(TWO)
    root = pathlib.Path(out)
    copies = {name: root / name for name in COPIES}
    for results in (four, two):
        for r, res in enumerate(results):
            for name, job in res.items():
                assert "error" not in job, f"rank {r} job {name}:\n{job['error']}"
    one = {}
    for name, src, at, steps in (("single", copies["one"], 4, 6), ("pp_single", root / "pp", 3, 4)):
        _, model, opt = _train_here(["--steps", str(at), "--ckpt-dir", src, "--resume"])     # loads, trains nothing
        from autoparallel.checkpoint import load_merged_state_dict, training_state

        newest = sorted(d for d in os.listdir(src) if d.startswith("step-"))[-1]
        state = training_state(model, opt)
        bad, boxes = mismatches(state, load_merged_state_dict(os.path.join(src, newest), flat=True))
        log, _, _ = _train_here(["--steps", str(steps), "--ckpt-dir", src, "--resume", "--save-every", "100"])
        one[name] = {"bad": bad, "boxes": boxes, "names": tensor_names(state),
                     "losses": [[s["step"], s["loss"]] for s in log["steps"]]}
    return {"root": root, "orig": _losses(four[0]["orig"]["losses"]), "four": four, "two": two, "one": one}


def _job(runs, name):
    """{rank: job result} of ``name``, from whichever launch ran it."""
    for key in ("four", "two"):
        if name in runs[key][0]:
            return {r: res[name] for r, res in enumerate(runs[key])}
    return {0: runs["one"][name]}


@pytest.mark.parametrize("name", ["z3_check", "tp2_check", "pp_check", "single"])
def test_loaded_tensors_equal_the_merged_checkpoint(runs, name):
    """Parameters and optimizer states, every box each rank holds, bit for bit."""
    for rank, job in _job(runs, name).items():
        assert job["boxes"] > 0 and job["bad"] == [], (name, rank, job["bad"][:5])


@pytest.mark.parametrize("name", ["z3", "tp2", "pp_from_zero", "single"])
def test_training_continues_with_the_original_losses(runs, name):
    for rank, job in _job(runs, name).items():
        got = _losses(job["losses"])
        assert sorted(got) == [4, 5], (name, rank, sorted(got))
        for step, loss in got.items():
            assert loss == pytest.approx(runs["orig"][step], rel=1e-5), (name, rank, step)


def test_zero_resume_is_bit_exact(runs):
    from autoparallel.checkpoint import load_merged_state_dict

    for rank, job in _job(runs, "z2_resume").items():
        assert _losses(job["losses"]) == {s: runs["orig"][s] for s in range(4, 8)}, rank
    root = runs["root"]
    a = load_merged_state_dict(root / "orig" / "step-00000008", flat=True)
    b = load_merged_state_dict(root / "z2" / "step-00000008", flat=True)
    assert sorted(a) == sorted(b)
    assert [n for n in a if not np.array_equal(a[n], b[n])] == []


def test_pipeline_resume_continues_the_run(runs):
    """Bit for bit: the resumed PP2xDP2 run continues the uninterrupted one exactly."""
    for rank in range(4):
        full = _losses(_job(runs, "pp_full")[rank]["losses"])
        resumed = _losses(_job(runs, "pp_resume")[rank]["losses"])
        assert sorted(full) == list(range(6)) and sorted(resumed) == [3, 4, 5]
        for s in (3, 4, 5):
            assert resumed[s] == full[s], (rank, s)


def test_pipeline_checkpoint_loads_into_one_process(runs):
    job = runs["one"]["pp_single"]
    assert job["boxes"] > 0 and job["bad"] == [], job["bad"][:5]
    full = _losses(_job(runs, "pp_full")[0]["losses"])
    got = _losses(job["losses"])
    assert sorted(got) == [3]
    assert got[3] == pytest.approx(full[3], rel=1e-5)


def test_entry_names_are_the_same_under_every_strategy(runs):
    from autoparallel.checkpoint import read_checkpoint_info

    root = runs["root"]
    saved = {what: sorted(read_checkpoint_info(root / d).names)
             for what, d in (("zero2", "orig/step-00000004"), ("zero3", "z3/step-00000006"),
                             ("tp2", "tp2/step-00000006"), ("pp2xdp2", "pp_full/step-00000006"))}
    held = {f"{name} rank {r}": job["names"] for name in ("z3_check", "tp2_check", "pp_check", "single", "pp_single")
            for r, job in _job(runs, name).items()}
    want = saved["zero2"]
    assert any(n.endswith("/moment2") for n in want) and any(n.startswith("model/") for n in want)
    for what, names in {**saved, **held}.items():
        assert names == want, (what, sorted(set(names) ^ set(want))[:6])


def test_negative_control_the_losses_move(runs):
    orig = runs["orig"]
    assert orig[4] != pytest.approx(orig[0], rel=1e-3) and orig[5] != pytest.approx(orig[4], rel=1e-3)
