"""ap.reconfigure on 4 gloo ranks with the default rebuild: a run that changes strategy mid-training
(DP4 -> DP2xTP2, DP4+ZeRO-2 -> TP4, DP2xTP2 -> DP4+ZeRO-3) continues the single-process run: the same losses at
every step and the same final parameters."""
import json
import os

import numpy as np
import pytest

from dist_scripts import shared_launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_scripts", "reconfigure_worker.py")
STEPS = 6
JOBS = [
    {"name": "dp4_to_dp2tp2", "before": {"dp": 4}, "after": {"dp": 2, "tp": 2}, "switch_at": 3, "steps": STEPS},
    {"name": "zero2_to_tp4", "before": {"dp": 4, "zero": 2}, "after": {"dp": 1, "tp": 4}, "switch_at": 3,
     "steps": STEPS},
    {"name": "dp2tp2_to_zero3", "before": {"dp": 2, "tp": 2}, "after": {"dp": 4, "zero": 3}, "switch_at": 2,
     "steps": STEPS},
]

JOB = shared_launch.job(__name__, "reconfigure", WORKER, 4, args=[json.dumps(JOBS)])


@pytest.fixture(scope="module")
def ranks():
    _, res = shared_launch.results(JOB)
    for r in res:
        for name, job in r["jobs"].items():
            assert "error" not in job, f"rank {r['rank']} {name}:\n{job['error']}"
    return res


@pytest.fixture(scope="module")
def ref():
    from zero_common import reference

    return reference(steps=STEPS)


@pytest.mark.parametrize("job", [j["name"] for j in JOBS])
def test_training_continues_under_the_new_strategy(ranks, ref, job):
    ref_losses, ref_params = ref
    for r in ranks:
        got = r["jobs"][job]
        np.testing.assert_allclose(got["losses"], ref_losses, rtol=1e-5, atol=1e-6, err_msg=job)
        assert set(got["params"]) == set(ref_params)
        for n, v in ref_params.items():
            np.testing.assert_allclose(np.asarray(got["params"][n]), v, rtol=1e-4, atol=5e-5, err_msg=f"{job} {n}")
    after = {j["name"]: j["after"] for j in JOBS}[job]
    assert np.asarray(ranks[0]["jobs"][job]["mesh"]).shape == (after.get("dp") or 1, after.get("tp", 1))
    assert ref_losses[-1] < ref_losses[0]
