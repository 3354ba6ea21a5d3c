"""`autoparallel calibrate` on 4 real gloo ranks in its short mode (three message sizes, three repeats): every
collective gets a latency/bandwidth fit per group size, the fits are the least-squares lines through the
measured points, the profile round-trips through JSON into a ClusterSpec and `autoparallel plan` prices
with it. The calibration worker runs in the 4-rank shared launch (dist_scripts/shared_launch.py) with the
arguments ``calibrate.run_ranks`` launches it with (checked here against run_ranks itself)."""
import json

import numpy as np
import pytest

from autoparallel.planner import calibrate
from autoparallel.planner.cli import main as plan_main
from autoparallel.planner.cluster import ClusterSpec
from dist_scripts import shared_launch

GROUP = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_to_all")
CONFIG = {"sizes": list(calibrate.QUICK_SIZES), "repeat": 3, "groups": calibrate.group_sizes(4)}
JOB = shared_launch.job(__name__, "calibrate", calibrate.WORKER, 4, args=[json.dumps(CONFIG)], timeout=300)


@pytest.fixture(scope="module")
def results():
    return shared_launch.results(JOB)[1]


def test_the_shared_job_is_what_run_ranks_launches(monkeypatch):
    from autoparallel.testing import launch

    calls = []
    monkeypatch.setattr(launch, "launch", lambda *a, **k: calls.append((a, k)) or ["rank0"])
    assert calibrate.run_ranks(4, calibrate.QUICK_SIZES, repeat=3) == ["rank0"]
    (script, nproc, args), _ = calls[0]
    assert (script, nproc, [json.loads(a) for a in args]) == (JOB.script, JOB.nproc, [CONFIG])


def test_every_collective_is_fitted(results):
    profile = calibrate.calibrated_profile(results)
    keys = {(f.collective, f.group_size) for f in profile.collectives}
    assert keys == {(c, n) for c in GROUP for n in (2, 4)} | {("send_recv", 2)}
    for f in profile.collectives:
        assert f.latency_s >= 0.0 and f.bandwidth_Bps > 0.0
        pts = np.array(calibrate.collective_points(results, f"{f.collective}/{f.group_size}"))
        assert len(pts) == len(calibrate.QUICK_SIZES) and (pts[:, 1] >= 0).all()
        w = calibrate.fit_weights(pts[:, 1])
        fitted = f.latency_s + pts[:, 0] / f.bandwidth_Bps
        residual = np.sum((w * (fitted - pts[:, 1])) ** 2)
        # least squares of relative errors over non-negative lines: no small move of the line does better
        for da, ds in ((1e-5, 0), (-1e-5, 0), (0, 1e-12), (0, -1e-12)):
            alpha, slope = f.latency_s + da, 1.0 / f.bandwidth_Bps + ds
            if alpha < 0 or slope < 0:
                continue
            assert np.sum((w * (alpha + slope * pts[:, 0] - pts[:, 1])) ** 2) >= residual * (1 - 1e-9)
    # bytes cost time: gathering 1 MB from each of 4 ranks is slower than 64 bytes
    gather = calibrate.collective_points(results, "all_gather/4")
    assert gather[-1][1] > gather[0][1]
    rt = profile.runtime
    assert rt.dispatch_s > rt.op_s > 0 and rt.backward_s > 0 and rt.optimizer_tensor_s > 0


def test_profile_round_trips_and_prices_plans(results, tmp_path, capsys):
    profile = calibrate.calibrated_profile(results)
    path = tmp_path / "cpu.json"
    profile.to_json(str(path))
    back = ClusterSpec.from_json(str(path))
    assert back == profile and back.backend == "gloo" and back.overlap == 0.0 and back.world_size == 4
    assert plan_main(["--model", "hidden=64,layers=2,heads=4,vocab=256,seq=16", "--cluster", str(path),
                      "--global-batch", "8", "--fixed", "dp=1,tp=4,micro_batch=8", "--json"]) == 0
    cand = json.loads(capsys.readouterr().out)["candidates"][0]
    ar = profile.collective_fit("all_reduce", 4)
    msg = 4.0 * 8 * 16 * 64                                   # fp32 activation of the micro-batch
    small = 4.0 * 8 * 16                                      # the vocab-parallel loss's per-token scalars
    expected = (2 * 2 + 1 + 2 * 2 + 1) * ar.seconds(msg) + 3 * ar.seconds(small)
    assert cand["time_breakdown_s"]["tp_comm"] == pytest.approx(expected, rel=1e-9)
