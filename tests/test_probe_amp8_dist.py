"""paddle.amp.GradScaler over ZeRO 1/2/3 on 2 real gloo ranks (one shared launch; dist_scripts/amp8_worker.py): a
backward from a tensor computed from the scaled loss, and the scaler's steps after a step without it, equal one
process, with step 1's overflow on the second rank only skipping the step and halving the scale on both ranks
(before, the scaler's step raised: the ZeRO buckets had reduced the gradients during the backward)."""
import os

import numpy as np
import pytest

from amp8_worker import STAGES, one_process
from dist_scripts import shared_launch

WORKER = os.path.join(os.path.dirname(__file__), "dist_scripts", "amp8_worker.py")
JOB = shared_launch.job(__name__, "amp8", WORKER, 2, args=lambda out: [], timeout=200)


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


@pytest.mark.parametrize("form", ["div", "warmup"])
def test_zero_grad_scaler_forms_equal_one_process_on_every_rank(ranks, form):
    want = one_process(form)
    assert want["scales"][-3:] == [2.0**15, 2.0**14, 2.0**14]             # step 1 skipped, the scale halved
    for r in ranks:
        for stage in STAGES:
            got = r[f"{stage}/{form}"]
            assert isinstance(got, dict), f"rank {r['rank']} {stage}: {got}"
            np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5, atol=1e-6)
            assert got["scales"] == want["scales"], (r["rank"], stage)
            for n, v in want["params"].items():
                np.testing.assert_allclose(got["params"][n], v, rtol=1e-5, atol=1e-6, err_msg=f"{stage} {n}")
