"""SMs held by communication kernels (PlannerOptions.comm_sm_fraction), figures by hand.

Source: DeepSeek-AI 2024 (arXiv:2412.19437) §3.2.2 ("only 20 SMs are sufficient to fully utilize the bandwidths of
IB and NVLink") and §3.5.1 (20 of the H800's 132 SMs, which "will limit the computational throughput").
"""
import dataclasses

import pytest

from autoparallel.planner.cluster import preset
from autoparallel.planner.config import ParallelConfig
from autoparallel.planner.cost_model import compute_share
from autoparallel.planner.model_spec import ModelSpec
from autoparallel.planner.options import PlannerOptions
from autoparallel.planner.published import MOE_RUNS
from autoparallel.planner.search import evaluate_config

TINY = ModelSpec("tiny", 64, 8, 4, 100, ffn=96, swiglu=True, bias=False, layernorm=False, tied_embeddings=False,
                 learned_positions=False, dropout=False)
ONE_GPU = preset("H100-80GB", 1, 1)
SOLO = ParallelConfig(dp=1)


def _no_memory_time(cluster):
    """The cluster with memory traffic free, so a step's compute is its matmuls alone."""
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bandwidth_Bps=1e30))


def test_matmul_peaks_scale_and_memory_bandwidth_does_not():
    shared = compute_share(ONE_GPU, 20 / 132)
    for dtype, rate in ONE_GPU.device.peak_flops:
        assert shared.device.flops(dtype) == pytest.approx(rate * 112 / 132, rel=1e-15)
    assert shared.device.memory_bandwidth_Bps == ONE_GPU.device.memory_bandwidth_Bps
    assert shared.device.memory_bytes == ONE_GPU.device.memory_bytes
    assert compute_share(ONE_GPU, 0.0) is ONE_GPU


def test_compute_time_grows_by_the_held_share_and_mfu_keeps_the_whole_peak():
    cluster = _no_memory_time(ONE_GPU)
    base = evaluate_config(TINY, cluster, 4, 32, SOLO, PlannerOptions())
    held = evaluate_config(TINY, cluster, 4, 32, SOLO, PlannerOptions(comm_sm_fraction=0.25))
    # matmuls on 3/4 of the SMs take 4/3 as long
    assert held.time_s["compute"] == pytest.approx(base.time_s["compute"] / 0.75, rel=1e-12)
    assert held.time_s["recompute"] == pytest.approx(base.time_s["recompute"] / 0.75, rel=1e-12)
    # MFU is measured against the whole device: the same FLOPs in a longer step
    assert held.mfu * held.step_time_s == pytest.approx(base.mfu * base.step_time_s, rel=1e-12)
    assert held.memory_per_device_gb == base.memory_per_device_gb


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5])
def test_bad_fraction_is_refused(bad):
    with pytest.raises(ValueError, match=r"comm_sm_fraction .* \[0, 1\), got"):
        PlannerOptions(comm_sm_fraction=bad)


def test_deepseek_v3_run_states_its_20_of_132_sms():
    (run,) = [r for r in MOE_RUNS if r.name == "DeepSeek-V3"]
    assert run.options().comm_sm_fraction == pytest.approx(20 / 132)
    assert "20 of the 132 SMs" in run.notes
