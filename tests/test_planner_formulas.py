"""Named cost-model formulas against values computed by hand."""
from dataclasses import replace

import numpy as np
import pytest

from autoparallel.planner import memory as mem
from autoparallel.planner.cluster import ClusterSpec, DeviceSpec, LinkSpec
from autoparallel.planner.config import ParallelConfig
from autoparallel.planner.cost_model import pipeline_bubble_fraction, pipeline_bubble_seconds, stage_params
from autoparallel.planner.model_spec import ModelSpec, parse_model
from autoparallel.planner.options import PlannerOptions
from autoparallel.planner.search import evaluate_config, grid_of
from autoparallel.planner.cost_model import evaluate

# a small GPT: h=64, l=4, a=4, V=1000, s=32 (P_mm = 12h² = 49152, other = 13h = 832 per block)
SMALL = parse_model("hidden=64,layers=4,heads=4,vocab=1000,seq=32")


def toy_cluster(devices=8, overlap=0.0):
    device = DeviceSpec("toy", (("bfloat16", 1e12),), 1e9, 1e11)
    link = LinkSpec(latency_s=0.0, bandwidth_Bps=1e10)
    return ClusterSpec("toy", 1, devices, device, link, link, overlap=overlap)


def test_small_model_parameter_counts():
    assert SMALL.layer_matmul_params == 12 * 64 * 64
    assert SMALL.layer_other_params == 13 * 64
    assert SMALL.params == 4 * (49152 + 832) + 1000 * 64 + 32 * 64 + 2 * 64


def test_stage_params_by_hand():
    first, last, layer = stage_params(SMALL, np.array([2]), np.array([2]))
    # column-parallel biases (q, k, v: 3h; MLP input: 4h = 448) are split by TP like the matrices
    assert layer[0] == (49152 + 448) / 2 + 832 - 448 == 25184
    assert first[0] == 2 * 25184 + 1000 * 64 / 2 + 32 * 64 == 84416       # blocks + vocab-parallel embedding
    assert last[0] == 2 * 25184 + 1000 * 64 / 2 + 2 * 64 == 82496         # blocks + tied head copy + final norm


def test_memory_of_a_small_config_by_hand():
    # dp=2 tp=2 pp=2, ZeRO-1, no recompute, micro-batch 2, global batch 16 -> 4 micro-batches
    opts = PlannerOptions(memory_reserve_fraction=0.0)
    cand = evaluate_config(SMALL, toy_cluster(), 16, 32, ParallelConfig(dp=2, tp=2, pp=2, sharding=1,
                                                                        micro_batch=2), opts)
    psi = 84416                                          # first stage
    per_layer = 32 * 2 * 64 * (10 + 24 / 2) + 5 * 4 * 32 * 32 * 2 / 2     # Korthikanti, TP without SP
    assert per_layer == 110592
    embedding_mask = 32 * 2 * 64                         # s·b·h one-byte dropout mask (no SP) per micro-batch
    # bf16 weights, the fp32 gradient accumulation buffer (4 B/param), ZeRO-1 states over dp=2
    expected = {"params": 2 * psi, "grads": 4 * psi, "optimizer": 12 * psi / 2,
                # 2 blocks x min(p, m) = 2 micro-batches in flight, and the embedding's mask for each of them
                "activations": 2 * per_layer * 2 + embedding_mask * 2,
                "zero3_buffer": 0, "reserve": 0}
    for key, value in expected.items():
        assert cand.memory_gb[key] * 1e9 == pytest.approx(value, rel=1e-12), key
    assert cand.memory_per_device_gb * 1e9 == pytest.approx(12 * psi + 2 * per_layer * 2 + 4096 * 2, rel=1e-12)


def test_korthikanti_table():
    gpt = ModelSpec("g", 1024, 2, 16, 1000, seq_len=512)
    s, b, h, a = 512, 2, 1024, 16
    one = np.array([1])

    def act(t, sp, rc):
        return float(mem.layer_activation_bytes(gpt, s, b, np.array([t]), np.array([sp]), np.array([rc]))[0])
    assert act(1, 0, 0) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert act(4, 0, 0) == pytest.approx(s * b * h * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    assert act(4, 1, 0) == pytest.approx(s * b * h / 4 * (34 + 5 * a * s / h))
    assert act(4, 1, 1) == pytest.approx(34 * s * b * h / 4)
    assert act(1, 0, 2) == pytest.approx(2 * s * b * h)
    assert act(4, 1, 2) == pytest.approx(2 * s * b * h / 4)
    assert float(mem.in_flight_micro_batches(np.array([4]), one, np.array([16]))[0]) == 4
    assert float(mem.in_flight_micro_batches(np.array([4]), np.array([2]), np.array([16]))[0]) == 4 * (1 + 3 / 8)


def test_first_stage_activations_follow_korthikanti_section_4_3():
    """A GPT (dropout) on tp=4 with SP, pp=4, selective recompute, 8 micro-batches of one sequence: the first stage
    keeps Korthikanti's 34·s·b·h/t per block for p micro-batches (Eq. 6 with L/p blocks x p), the embedding
    dropout's mask s·b·h·p/t (§4.3), and while one block runs backward its rebuilt scores 5·a·s²·b/t."""
    gpt = ModelSpec("g", 1024, 8, 16, 1000, seq_len=512)
    s, b, h, a, t, p = 512, 1, 1024, 16, 4, 4
    blocks = 34 * s * b * h / t * (8 / p) * p
    mask = s * b * h * p / t
    scores = 5 * a * s * s * b / t
    assert (blocks, mask, scores) == (35_651_584, 524_288, 5_242_880)
    opts = PlannerOptions(memory_reserve_fraction=0.0)
    cand = evaluate_config(gpt, toy_cluster(16), 8, s, ParallelConfig(dp=1, tp=t, pp=p, sp=1, recompute="selective"),
                           opts)
    assert cand.memory_gb["activations"] * 1e9 == pytest.approx(blocks + mask + scores, rel=1e-12)
    # without dropout (LLaMA-style) there is no mask to keep
    no_dropout = replace(gpt, dropout=False)
    assert float(mem.embedding_dropout_bytes(no_dropout, s, b, np.array([t]), np.array([1]))[0]) == 0.0
    assert float(mem.embedding_dropout_bytes(gpt, s, b, np.array([t]), np.array([0]))[0]) == s * b * h


def test_head_stage_keeps_norm_and_projection_inputs_and_logits():
    """The stage holding the output head keeps the final norm's and the projection's inputs, 2·s·b·h/t each with SP
    (2·s·b·h each without), and the fp32 logits 4·s·b·V/t (Korthikanti et al. §4.3: 4·s·b·h/t·(1 + V/h)); on a
    single stage (p = 1) the first stage is that stage."""
    from autoparallel.planner.stage_memory import stage_rows

    gpt = ModelSpec("g", 1024, 8, 16, 1000, seq_len=512)
    s, b, h, V, t = 512, 1, 1024, 1000, 4
    with_sp = 4 * s * b * h / t * (1 + V / h)
    assert with_sp == 1_036_288
    one, four = np.array([1]), np.array([4])
    rows = stage_rows(gpt, s, b, four, one, four, one, np.array([8.0]), four // 2, four // 2, four // 2, 0.0, 0.0)
    assert float(rows[1][3][0]) == pytest.approx(with_sp, rel=1e-12)               # last stage
    assert float(rows[0][3][0]) == pytest.approx(s * b * h * 4 / t, rel=1e-12)     # first: the mask only
    single = stage_rows(gpt, s, b, four, np.array([0]), one, one, np.array([8.0]), 8, 8, 0, 0.0, 0.0)
    assert float(single[0][3][0]) == pytest.approx(4 * s * b * h + 4 * s * b * V / t + s * b * h, rel=1e-12)
    assert float(mem.head_input_bytes(gpt, s, b, four, one, scale=2.0)[0]) == 2 * 4 * s * b * h / t   # fp32


def test_model_states_by_zero_stage():
    psi, d = 1000.0, 4
    totals = []
    for stage in range(4):
        z = np.array([stage])
        totals.append(float((mem.weight_bytes(psi, z, d, 2) + mem.grad_bytes(psi, z, d, 2)
                             + mem.optimizer_bytes(psi, z, d, np.array([0]), 12))[0]))
    assert totals == [16 * psi, 4 * psi + 12 * psi / d, 2 * psi + 14 * psi / d, 16 * psi / d]
    assert float(mem.optimizer_bytes(psi, np.array([1]), d, np.array([1]), 12)[0]) == 0.0


def test_bubble_formulas():
    assert pipeline_bubble_fraction(4, 1, 12) == pytest.approx(3 / 15)
    assert pipeline_bubble_fraction(4, 2, 12) == pytest.approx(3 / 27)
    t_mb, p, v, m = 0.5, 4, 2, 12
    bubble = pipeline_bubble_seconds(p, v, t_mb)
    assert bubble / (m * t_mb + bubble) == pytest.approx(pipeline_bubble_fraction(p, v, m))


def test_step_time_of_a_small_config_by_hand():
    # tp=2 inside the node, dp=pp=1, micro-batch 2, global batch 4 -> 2 micro-batches; overlap 0
    opts = PlannerOptions(gemm_efficiency=0.5, activation_traffic_factor=1.0)
    cand = evaluate_config(SMALL, toy_cluster(devices=2), 4, 32, ParallelConfig(dp=1, tp=2, micro_batch=2), opts)
    flops_layer = 2 * 32 * (2 * 49152 + 4 * 32 * 64) / 2
    t_layer = flops_layer / (1e12 * 0.5) + 110592 / 1e11
    t_logits = 2 * 2 * 32 * 64 * 1000 / 2 / (1e12 * 0.5) + 4 * 32 * 2 * 1000 / 2 / 1e11
    all_reduce = 2 * (2 - 1) / 2 * (2 * 2 * 32 * 64) / 1e10
    t_mb = 4 * 3 * t_layer + 3 * t_logits + 4 * 4 * all_reduce
    psi = 4 * 25184 + 1000 * 64 / 2 + 32 * 64 + 2 * 64      # column-parallel biases split by TP
    optimizer = 30 * psi / 1e11                              # read the fp32 grad 4, states 2·12, write weight 2
    assert cand.time_s["tp_comm"] == pytest.approx(2 * 16 * all_reduce, rel=1e-12)
    assert cand.step_time_s == pytest.approx(2 * t_mb + optimizer, rel=1e-12)
    tokens = 4 * 32
    assert cand.tokens_per_s == pytest.approx(tokens / cand.step_time_s)
    assert cand.mfu == pytest.approx(SMALL.model_flops_per_token(32) * tokens / (cand.step_time_s * 2 * 1e12))


def test_megatron_flops_with_full_recompute():
    gpt = parse_model("megatron-18b")
    cand = evaluate_config(gpt, toy_cluster(devices=8), 8, 2048, ParallelConfig(dp=1, tp=8, recompute="full"),
                           PlannerOptions(memory_reserve_fraction=0.0))
    B, s, l, h, V = 8, 2048, 40, 6144, 51200
    megatron = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert cand.tflops_per_device * 1e12 == pytest.approx(megatron / (cand.step_time_s * 8), rel=1e-12)
    model_flops = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert cand.mfu == pytest.approx(model_flops / (cand.step_time_s * 8 * 1e12), rel=1e-12)


def test_overlap_hides_dp_sync():
    config = ParallelConfig(dp=8, micro_batch=1)
    hidden = evaluate_config(SMALL, toy_cluster(overlap=1.0), 8, 32, config, PlannerOptions())
    exposed = evaluate_config(SMALL, toy_cluster(overlap=0.0), 8, 32, config, PlannerOptions())
    assert exposed.time_s["dp_comm"] > hidden.time_s["dp_comm"] >= 0.0
    assert exposed.step_time_s > hidden.step_time_s


def test_gloo_prices_reduce_scatter_as_all_reduce():
    gloo = ClusterSpec("cpu", 1, 4, DeviceSpec("cpu", (("bfloat16", 1e11),), 1e10, 1e10),
                       LinkSpec(1e-5, 1e9), LinkSpec(1e-5, 1e9), backend="gloo", overlap=0.0)
    nccl = ClusterSpec("cpu", 1, 4, DeviceSpec("cpu", (("bfloat16", 1e11),), 1e10, 1e10),
                       LinkSpec(1e-5, 1e9), LinkSpec(1e-5, 1e9), backend="nccl", overlap=0.0)
    grid = grid_of([ParallelConfig(dp=4, sharding=2)])
    opts = PlannerOptions()
    assert evaluate(SMALL, gloo, 8, 32, grid, opts)["dp_comm_s"][0] > evaluate(SMALL, nccl, 8, 32, grid, opts)["dp_comm_s"][0]


def test_parallel_block_has_one_forward_all_reduce():
    """GPT-J / GPT-NeoX blocks sum attention and MLP before one forward all-reduce; the backward keeps two."""
    from dataclasses import replace

    from autoparallel.planner.cost_model import tp_collectives_per_layer

    assert [int(tp_collectives_per_layer(rc)) for rc in (0, 2)] == [4, 6]       # none, full recompute
    assert [int(tp_collectives_per_layer(rc, True)) for rc in (0, 2)] == [3, 4]
    parallel = replace(SMALL, parallel_block=True)
    all_reduce = 2 * (2 - 1) / 2 * (2 * 2 * 32 * 64) / 1e10                     # as in the by-hand step above
    opts = PlannerOptions(gemm_efficiency=0.5, activation_traffic_factor=1.0, memory_reserve_fraction=0.0)
    for rc, calls in (("none", 3), ("full", 4)):
        config = ParallelConfig(dp=1, tp=2, micro_batch=2, recompute=rc)
        cand = evaluate_config(parallel, toy_cluster(devices=2), 4, 32, config, opts)
        assert cand.time_s["tp_comm"] == pytest.approx(2 * 4 * calls * all_reduce, rel=1e-12)
    # negative control: sequence parallelism keeps the sequential block's count (4 gather/scatter pairs)
    sp = ParallelConfig(dp=1, tp=2, micro_batch=2, sp=1)
    a = evaluate_config(parallel, toy_cluster(devices=2), 4, 32, sp, opts)
    b = evaluate_config(SMALL, toy_cluster(devices=2), 4, 32, sp, opts)
    assert b.time_s["tp_comm"] > 0
    assert a.time_s["tp_comm"] == pytest.approx(b.time_s["tp_comm"], rel=1e-12)
