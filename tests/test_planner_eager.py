"""Calibration fits and profiles, and the eager-runtime (CPU) cost path, against values computed by hand
and against live-tensor bytes of the runtime itself (simulated world)."""
import dataclasses
import json
import math

import numpy as np
import pytest

from autoparallel.planner import calibrate
from autoparallel.planner.api import plan
from autoparallel.planner.cluster import ClusterSpec, CollectiveFit, RuntimeSpec, parse_cluster
from autoparallel.planner.model_spec import parse_model
from autoparallel.planner.profiles import cpu_default, for_world


# ---- fits and profiles ---------------------------------------------------------------------------------
def test_fit_recovers_an_exact_line_and_clamps_a_flat_one():
    pts = [[b, 3e-4 + b / 2e8] for b in (64, 65536, 1048576, 4194304)]
    alpha, bw = calibrate.fit_alpha_beta(pts)
    assert alpha == pytest.approx(3e-4, rel=1e-6) and bw == pytest.approx(2e8, rel=1e-6)
    alpha, bw = calibrate.fit_alpha_beta([[64, 2e-3], [1e6, 1e-3]])      # noise made it fall: no bytes term
    assert bw == calibrate.UNBOUNDED_BANDWIDTH and alpha == pytest.approx(  # relative errors: the 1/t²-weighted mean
        (1 / 2e-3 + 1 / 1e-3) / (1 / 2e-3 ** 2 + 1 / 1e-3 ** 2))
    with pytest.raises(ValueError, match="two message sizes"):
        calibrate.fit_alpha_beta([[64, 1e-3]])


def fake_results(world=4, reps=3, latency=1e-3, bandwidth=1e8, work=2e-3):
    """Worker output with known timings: rank r is r*1e-4 s slower on everything (the slowest rank counts)."""
    out = []
    sizes = [64, 1048576]
    for r in range(world):
        skew = r * 1e-4
        coll = {}
        for key in ("all_reduce/2", "all_reduce/4", "send_recv/2"):
            factor = 0.5 if key.startswith("send_recv") else 1.0
            after = [[work + skew + (latency + b / bandwidth) / factor] * reps for b in sizes]
            coll[key] = {"bytes": sizes, "after": after, "work": [work + skew] * reps, "factor": factor}
        out.append({"world": world, "rank": r, "collectives": coll,
                    "runtime": {"plain": [200 * 2e-6 + skew] * reps, "plain_ops": 200,
                                "forward": [25 * 8e-5 + skew] * reps, "backward": [25 * 3e-5 + skew] * reps,
                                "step": [16 * 3e-5 + skew] * reps, "ops": 25, "tensors": 16,
                                "train": [25 * 1.1e-4 + skew] * reps, "recomputed_ops": 20,
                                "train_recompute": [25 * 1.1e-4 + 20 * 5e-4 + skew] * reps},
                    "device": {"matmul": [0.01 + skew] * reps, "flop": 2.0 * 256 ** 3 * 8, "matmul_n": 256,
                               "copy": [0.001 + skew] * reps, "bytes": 16.0 * 2 ** 20}})
    return out


def test_profile_from_worker_results_and_json_round_trip(tmp_path):
    results = fake_results()
    profile = calibrate.calibrated_profile(results, memory_bytes=8e9)
    fit = profile.collective_fit("all_reduce", 4)
    assert fit.latency_s == pytest.approx(1e-3, rel=1e-6) and fit.bandwidth_Bps == pytest.approx(1e8, rel=1e-6)
    assert profile.collective_fit("send_recv", 2).latency_s == pytest.approx(1e-3, rel=1e-6)
    slow = 3e-4                                                  # rank 3's extra time on every repetition
    assert profile.runtime.dispatch_s == pytest.approx((25 * 8e-5 + slow) / 25)
    assert profile.runtime.optimizer_tensor_s == pytest.approx((16 * 3e-5 + slow) / 16)
    assert profile.runtime.recompute_op_s == pytest.approx(5e-4)          # the difference of the two runs
    assert profile.device.flops("float32") == pytest.approx(2.0 * 256 ** 3 * 8 / (0.01 + slow))
    assert profile.backend == "gloo" and profile.overlap == 0.0 and profile.world_size == 4
    path = tmp_path / "p.json"
    profile.to_json(str(path))
    back = parse_cluster(str(path))
    assert back == profile and hash(back) == hash(profile)
    # two launches fitted together: the mean over both
    twice = calibrate.calibrated_profile(results + fake_results(latency=3e-3), memory_bytes=8e9)
    assert twice.collective_fit("all_reduce", 4).latency_s == pytest.approx(2e-3, rel=1e-6)


def test_malformed_profile_is_a_typed_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="profile"):
        parse_cluster(str(path))


def test_measured_fit_replaces_the_link_formula():
    """TP4 on a profile: the TP term is the count of the runtime's all_reduces times the measured fit."""
    a4 = 2e-3
    fits = (CollectiveFit("all_reduce", 4, a4, calibrate.UNBOUNDED_BANDWIDTH),)
    rt = RuntimeSpec(op_s=0.0, dispatch_s=0.0, backward_s=0.0, optimizer_tensor_s=0.0)
    cluster = calibrate.cpu_profile(1e30, 1e30, 1e12, 4, collectives=fits, runtime=rt)
    model = parse_model("hidden=64,layers=2,heads=4,vocab=256,seq=16")
    cand = plan(model, cluster, global_batch_size=8, seq_len=16, fixed="dp=1,tp=4,micro_batch=8").candidates[0]
    # forward: 2 row-parallel per block + the vocab-parallel embedding + 3 in the vocab-parallel loss;
    # backward: 2 column-parallel inputs per block + the LM head's input
    assert cand.time_s["tp_comm"] == pytest.approx((2 * 2 + 1 + 3 + 2 * 2 + 1) * a4, rel=1e-6)
    assert cand.time_s["overhead"] == 0.0 and cand.time_s["dp_comm"] == 0.0


def test_dp_step_by_hand():
    """DP4: per-op overheads, the loss scalars, the position table's gradient and one bucket."""
    a4, d, b, opt, op = 4e-3, 1e-4, 3e-5, 2e-5, 1e-6
    fits = (CollectiveFit("all_reduce", 4, a4, calibrate.UNBOUNDED_BANDWIDTH),)
    rt = RuntimeSpec(op_s=op, dispatch_s=d, backward_s=b, optimizer_tensor_s=opt)
    cluster = calibrate.cpu_profile(1e30, 1e30, 1e12, 4, collectives=fits, runtime=rt)
    model = parse_model("hidden=32,layers=2,heads=4,vocab=256,seq=16")
    ops = model.op_profile()
    assert (ops.layer_ops, ops.outside_ops, ops.layer_tensors, ops.outside_tensors) == (21, 6, 12, 4)
    cand = plan(model, cluster, global_batch_size=8, seq_len=16, fixed="dp=4,micro_batch=2").candidates[0]
    forward_ops = 2 * 21 + 6
    tensors = 2 * 12 + 4
    assert cand.time_s["overhead"] == pytest.approx(forward_ops * (d + b), rel=1e-9)
    assert cand.time_s["dp_comm"] == pytest.approx((2 + 1 + 1) * a4, rel=1e-6)
    assert cand.time_s["optimizer"] == pytest.approx(tensors * opt + 6 * tensors * op, rel=1e-6)
    accum = plan(model, cluster, global_batch_size=8, seq_len=16, fixed="dp=4,micro_batch=1").candidates[0]
    assert accum.time_s["dp_comm"] == pytest.approx((2 * (2 + 1) + 1) * a4, rel=1e-6)
    assert accum.time_s["overhead"] == pytest.approx(2 * forward_ops * (d + b), rel=1e-9)
    full = plan(model, cluster, global_batch_size=8, seq_len=16, fixed="dp=4,micro_batch=2,recompute=full")
    assert full.candidates[0].time_s["overhead"] == pytest.approx((forward_ops + 2 * 21) * d + forward_ops * b)


def test_gpu_presets_are_untouched_by_the_eager_path():
    c = plan("llama2-7b", "1x8:A100-80GB", global_batch_size=64, seq_len=4096, top=1).candidates[0]
    assert c.time_s["overhead"] == 0.0


def test_for_world_resizes_a_cpu_profile_to_one_node():
    p = for_world(cpu_default(4), 8)
    assert (p.num_nodes, p.devices_per_node) == (1, 8) and p.runtime is not None
    assert for_world(parse_cluster("2x8:A100-80GB"), 32).num_nodes == 4
    with pytest.raises(ValueError, match="positive"):
        for_world(cpu_default(), 0)


# ---- predicted state bytes = live bytes of the runtime ----------------------------------------------------
@pytest.mark.parametrize("fixed,flags", [
    ("dp=4", {}), ("dp=1,tp=4", {"tp": 4}), ("dp=2,tp=2", {"dp": 2, "tp": 2}),
    ("dp=4,sharding=1", {"stage": 1}), ("dp=4,sharding=2", {"stage": 2}), ("dp=4,sharding=3", {"stage": 3})])
def test_predicted_state_bytes_equal_live_bytes(fixed, flags):
    """Parameters + gradients + optimizer states of rank 0 after one step in the simulated world of 4 ranks
    (counted from live tensors, as the examples' logs do) equal the planner's prediction exactly."""
    import paddle
    import paddle.nn.functional as F

    import autoparallel as ap
    import train_common
    from models import PRESETS, build
    from autoparallel.planner.model_spec import ModelSpec

    config = dataclasses.replace(PRESETS["gpt-tiny"], vocab_size=256)
    spec = ModelSpec.from_trace(build(config, lazy=True), 16, 8)
    dp = 4 // flags.get("tp", 1)
    cand = plan(spec, cpu_default(), global_batch_size=8, seq_len=16, fixed=f"{fixed},micro_batch={8 // dp}")
    predicted = sum(cand.candidates[0].memory_gb[k] for k in ("params", "grads", "optimizer")) * 1e9
    s = ap.Strategy()
    s.data_parallel.degree = dp
    s.tensor_parallel.degree = flags.get("tp", 1)
    if "stage" in flags:
        s.sharding.enable, s.sharding.stage = True, flags["stage"]
    with ap.simulate(4):
        paddle.seed(0)
        model = build(config)
        opt = paddle.optimizer.AdamW(parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=s)
        ids = paddle.randint(0, 256, [8, 16])
        F.cross_entropy(model(ids), ids).backward()
        opt.step()
        live = train_common.memory_bytes(model, opt)
    measured = live["params"] + live["grads"] + live["optimizer_states"]
    assert predicted == pytest.approx(measured, rel=1e-12), (predicted, live)
