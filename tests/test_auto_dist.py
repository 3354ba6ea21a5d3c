"""Real gloo ranks: the GPT example with --auto (auto_mode 'full') on 4 CPU ranks picks a configuration
with the calibrated profile named by AP_CLUSTER_PROFILE, prints the plan's explanation, trains, and matches
the single-process run (losses every step and final parameters, the checks of tests/test_train_dist.py);
a negative control (every rank loads the same data shard) fails the same comparison. One launch."""
import dataclasses
import json
import os
import pathlib

import numpy as np
import pytest

from autoparallel.planner import auto
from autoparallel.planner.profiles import cpu_default
from autoparallel.strategy import Strategy
from dist_scripts import shared_launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_scripts", "auto_train_worker.py")

STEPS = 10
COMMON = ["--steps", str(STEPS), "--seed", "0", "--batch-size", "8", "--seq-len", "16", "--lr", "3e-3"]
JOBS = [{"name": "auto", "argv": ["--auto"] + COMMON},
        {"name": "neg_wrong_batch", "argv": ["--auto"] + COMMON, "negative": "wrong_batch"}]


def _args(out):
    """The launch's arguments, after writing the calibrated profile AP_CLUSTER_PROFILE names."""
    cpu_default().to_json(os.path.join(out, "profile.json"))
    return [out, json.dumps(JOBS)]


JOB = shared_launch.job(__name__, "auto", WORKER, 4, args=_args,
                        env=lambda out: {auto.ENV_PROFILE: os.path.join(out, "profile.json")})


@pytest.fixture(scope="module")
def reference():
    import train_common

    args = train_common.make_parser("gpt-tiny").parse_args(COMMON)
    log, model, _ = train_common.train(args)
    return [s["loss"] for s in log["steps"]], {n: p.numpy() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def run():
    out, ranks = shared_launch.results(JOB)
    return pathlib.Path(out), ranks, os.path.join(out, "profile.json")


def matches(job, ranks, out, reference):
    ref_losses, ref_params = reference
    ok_loss = all(np.allclose(r["jobs"][job]["losses"], ref_losses, rtol=1e-4, atol=1e-6) for r in ranks)
    params = np.load(os.path.join(out, job + ".npz"))
    ok_params = set(params.files) == set(ref_params) and all(
        np.allclose(params[n], ref_params[n], rtol=1e-4, atol=5e-5) for n in ref_params)
    return ok_loss, ok_params


def test_auto_picks_prints_trains_and_matches_one_process(run, reference):
    out, ranks, profile = run
    job = ranks[0]["jobs"]["auto"]
    chosen = Strategy.from_dict(job["strategy"])
    assert chosen.auto_mode == "semi"
    # the configuration is the one the planner picks in this process for the same model and profile
    import train_common
    from models import build

    model = build(train_common.model_config("gpt-tiny", 16, 256), lazy=True)
    user = Strategy()
    user.auto_mode, user.global_batch_size, user.seed = "full", 8, 0
    expected, result = auto.choose(model, user, 4, seq_len=16, cluster=profile)
    assert chosen.to_dict() == expected.to_dict()
    assert all(r["jobs"]["auto"]["strategy"] == job["strategy"] for r in ranks)
    printed = job["printed"]
    assert "auto_mode='full': planned for 4 ranks on 1x4:cpu-default" in printed
    assert result.best.config.short() in printed and "Why #1" in printed
    assert all(r["jobs"]["auto"]["printed"] == "" for r in ranks[1:])     # rank 0 explains, once
    ok_loss, ok_params = matches("auto", ranks, out, reference)
    got = job["losses"]
    assert ok_loss, f"losses {np.round(got, 5).tolist()} vs single process {np.round(reference[0], 5).tolist()}"
    assert ok_params, "final parameters differ from the single-process run"
    assert reference[0][-1] < reference[0][0] - 0.3                  # it does learn


def test_negative_control_fails_the_same_comparison(run, reference):
    out, ranks, _ = run
    chosen = Strategy.from_dict(ranks[0]["jobs"]["neg_wrong_batch"]["strategy"])
    assert chosen.data_parallel.degree > 1, "the wrong-batch control needs data parallelism to break"
    assert matches("neg_wrong_batch", ranks, out, reference) == (False, False)
