"""DualPipe's time in the planner, figures by hand.

Source: DeepSeek-AI 2024 (arXiv:2412.19437) §3.2.1 and Table 2: bubbles 1F1B (PP-1)(F+B), ZB1P (PP-1)(F+B-2W),
DualPipe (PP/2-1)(F&B+B-3W); parameters 2x, activations PP+1; stages and micro-batches divisible by 2.
deepseek-ai/DualPipe: rank r holds stages r and PP-1-r (examples/example_dualpipe.py); dualpipe.py's ``step``
asserts num_chunks >= num_ranks * 2.
"""
import dataclasses

import numpy as np
import pytest

import autoparallel as ap
from autoparallel.planner import dualpipe as D
from autoparallel.planner.cluster import DEVICES, preset
from autoparallel.planner.config import ParallelConfig, parse_fixed
from autoparallel.planner.cost_model import (_time_per_layer, logits_weight_grad_seconds, weight_grad_seconds)
from autoparallel.planner.model_spec import ModelSpec
from autoparallel.planner.params import block_and_edge_params
from autoparallel.planner.options import PlannerOptions
from autoparallel.planner.published import MOE_RUNS, predict, search_best
from autoparallel.planner.search import SearchSpace, evaluate_config, exhaustive, invalid_reason, search

LLAMA_STYLE = dict(swiglu=True, bias=False, layernorm=False, tied_embeddings=False, learned_positions=False,
                   dropout=False)
# h 64, 8 blocks, 4 heads, vocab 100, SwiGLU MLP of 96: 4·64² + 3·64·96 = 34816 matmul weights per block
TINY = ModelSpec("tiny", 64, 8, 4, 100, ffn=96, **LLAMA_STYLE)
H100 = DEVICES["H100-80GB"]
OPTS = PlannerOptions()
# 8 H100 on one node: dp 2 x pp 4, micro-batch 1, batch 16 -> 8 micro-batches (even, = 2·pp)
CLUSTER = preset("H100-80GB", 1, 8)
DUAL = ParallelConfig(dp=2, pp=4, dualpipe=1)


# ---- Table 2 ---------------------------------------------------------------------------------------------
def test_table_2_bubbles_by_hand():
    F, B, W = 1.0, 2.0, 1.0                    # ms: a forward chunk, a full backward chunk, its weight part
    FB = D.overlapped_pair_seconds(F, B, 0.5)  # the overlapped pair's compute, above its 0.5 ms of communication
    assert FB == 3.0
    assert D.one_f_one_b_bubble(8, F, B) == 7 * 3.0            # (8-1)(1+2)       = 21
    assert D.zb1p_bubble(8, F, B, W) == 7 * 1.0                # (8-1)(1+2-2)     = 7
    assert D.dualpipe_bubble(8, FB, B, W) == 3 * 2.0           # (8/2-1)(3+2-3)   = 6
    assert D.dualpipe_bubble(8, FB, B, W) < D.zb1p_bubble(8, F, B, W) < D.one_f_one_b_bubble(8, F, B)
    assert D.dualpipe_bubble(2, FB, B, W) == 0.0               # (2/2-1)(...)     = 0
    # communication the pair overlaps longer than its compute bounds F&B: (4-1)(5+2-3) = 12
    assert D.overlapped_pair_seconds(F, B, 5.0) == 5.0
    assert D.dualpipe_bubble(8, D.overlapped_pair_seconds(F, B, 5.0), B, W) == 12.0


def test_weight_gradients_by_hand():
    """W is the weight-gradient GEMMs: the linear layers' forward FLOPs again, none for the attention core."""
    s, b, one, zero = 32.0, 1.0, np.array([1]), np.array([0])
    linear = 2 * 34816 * 32                                     # 2·P_mm·s = 2,228,224 FLOPs
    expected = linear / (989e12 * 0.661)
    assert weight_grad_seconds(TINY, OPTS, H100, s, b, one, zero)[0] == pytest.approx(expected, rel=1e-12)
    # linear in s (the attention core's 4·s²·h would not be), split by TP
    assert weight_grad_seconds(TINY, OPTS, H100, 64.0, b, one, zero)[0] == pytest.approx(2 * expected, rel=1e-12)
    assert weight_grad_seconds(TINY, OPTS, H100, s, b, np.array([2]), zero)[0] == pytest.approx(expected / 2)
    # below the forward (which has the attention core and the element-wise traffic too)
    t_fwd = _time_per_layer(TINY, OPTS, H100, s, b, one, zero, zero)[0][0]
    assert weight_grad_seconds(TINY, OPTS, H100, s, b, one, zero)[0] < t_fwd
    # the head: 2·s·h·V = 2·32·64·100 = 409,600 FLOPs
    assert logits_weight_grad_seconds(TINY, OPTS, H100, s, b, 1) == pytest.approx(409600 / (989e12 * 0.661))


def test_rank_r_holds_stages_r_and_pp_minus_1_minus_r():
    # DeepSeek-V3's 61 blocks on 16 stages, ends split: 2, 4, 5, 4 x 11, 2 -> rank 0: 2 + 2; rank 2: 5 + 4
    counts = (2, 4, 5) + (4,) * 12 + (2,)
    assert sum(counts) == 61 and D.pair_blocks(counts) == (4, 9)
    assert D.pair_blocks((3, 5)) == (8, 0)                       # pp 2: both ranks hold both stages
    pp, dual = np.array([16, 16]), np.array([True, False])
    (first, last, mid), heads, live = D.device_blocks(np.array([4.0, 4.0]), np.array([9.0, 9.0]), pp, dual,
                                                      np.array([2.0, 2.0]), np.array([2.0, 2.0]), np.array([5.0, 5.0]))
    assert list(first) == [2.0, 2.0] and list(mid) == [4.5, 5.0] and list(heads[0]) == [0.5, 0.0]
    assert list(live[1]) == [False, True]                        # DualPipe: no separate last-stage device


def test_only_ranks_that_can_be_the_fullest_are_priced():
    """``frontier`` keeps rank 0 (it holds the embedding and the head) and the ranks no other rank dominates in
    blocks held and in flight; for any non-negative costs per block held and per block in flight, the fullest rank
    of the frontier is the fullest of all."""
    from autoparallel.planner.stages import frontier
    loads = D.rank_loads((2, 4, 5) + (4,) * 12 + (2,))
    # rank 1: 4 + 4 held, 4·15 + 4·2 = 68; rank 2: 5 + 4, 5·14 + 4·3 = 82; ranks 3-7 as rank 1
    assert loads[:3] == ((4, 34), (8, 68), (9, 82)) and set(loads[3:]) == {(8, 68)}
    assert frontier(loads) == ((4, 34), (9, 82))
    rng = np.random.default_rng(0)
    for counts in [tuple(rng.integers(1, 9, size=p)) for p in (4, 6, 8, 16) for _ in range(20)]:
        every, kept = D.rank_loads(counts)[1:], frontier(D.rank_loads(counts))[1:]
        for a, c in rng.random((10, 2)):
            assert max(a * x + c * y for x, y in kept) == max(a * x + c * y for x, y in every)


def _block_parts():
    s, b, one, zero = 32.0, 1.0, np.array([1]), np.array([0])
    t_fwd, _, t_logits = (x[0] for x in _time_per_layer(TINY, OPTS, H100, s, b, one, zero, zero))
    return t_fwd, t_logits, weight_grad_seconds(TINY, OPTS, H100, s, b, one, zero)[0], \
        logits_weight_grad_seconds(TINY, OPTS, H100, s, b, 1)


def test_dualpipe_step_by_hand():
    """pp 4, 2 blocks per stage, tp 1, no recompute: a block is F = t_fwd, B = 2·t_fwd; the head F = t_logits,
    B = 2·t_logits. Rank 0 (stages 0 and 3) runs 2 blocks and half the head per micro-batch, the others 2 blocks:
    rank 0 is slowest. Its chunk: F = 2·t_fwd + t_logits/2, B = 4·t_fwd + t_logits, W = 2·W_L + W_head/2;
    bubble (4/2-1)(F + B + B - 3W); compute 8 micro-batches x (2·3·t_fwd + 3·t_logits/2)."""
    t_fwd, t_logits, W_L, W_head = _block_parts()
    dual = evaluate_config(TINY, CLUSTER, 16, 32, DUAL, OPTS)
    plain = evaluate_config(TINY, CLUSTER, 16, 32, dataclasses.replace(DUAL, dualpipe=0), OPTS)
    F, B, W = 2 * t_fwd + t_logits / 2, 4 * t_fwd + t_logits, 2 * W_L + W_head / 2
    assert dual.time_s["bubble"] == pytest.approx(1 * (F + B + B - 3 * W), rel=1e-9)
    assert dual.time_s["compute"] == pytest.approx(8 * (6 * t_fwd + 1.5 * t_logits), rel=1e-9)
    # 1F1B: the last stage (2 blocks + the whole head) sets the pace; bubble = the 3 other stages' 6 blocks
    assert plain.time_s["compute"] == pytest.approx(8 * (6 * t_fwd + 3 * t_logits), rel=1e-9)
    assert plain.time_s["bubble"] == pytest.approx(6 * 3 * t_fwd, rel=1e-9)
    assert dual.time_s["bubble"] < plain.time_s["bubble"]       # (the step is not: this toy's gradient sum with
                                                                 # the partner costs more latency than the bubble saves)
    # memory: rank 0 holds stages 0 and 3 (4 blocks, the embedding and the head), every stage lives on two ranks;
    # 1F1B's fullest stage is the first (4 micro-batches in flight): 2 blocks and the embedding
    block, _, emb, head = (float(np.asarray(x).reshape(-1)[0]) for x in block_and_edge_params(TINY, 1, np.array([4]), 1))
    assert dual.memory_gb["params"] == pytest.approx(2 * (4 * block + emb + head) / 1e9, rel=1e-12)
    assert dual.memory_gb["grads"] == pytest.approx(4 * (4 * block + emb + head) / 1e9, rel=1e-12)
    assert plain.memory_gb["params"] == pytest.approx(2 * (2 * block + emb) / 1e9, rel=1e-12)


def test_dualpipe_gradients_and_shards_cover_the_ranks_two_stages():
    """A DualPipe rank holds stages r and PP-1-r, so its gradient sum and optimizer step cover both, and each stage
    lives on 2·dp ranks: summed over the dp group, then its 1/dp part with the partner (priced half the world
    away); ZeRO shards over 2·dp. pp 4 of 2 blocks on the 8 GPUs of one node (every collective on NVLink)."""
    from autoparallel.planner.links import priced
    block, _, emb, head = (float(np.asarray(x).reshape(-1)[0]) for x in block_and_edge_params(TINY, 1, np.array([4]), 1))
    pair, stage = 4 * block + emb + head, 2 * block + head          # rank 0's two stages; 1F1B's largest stage
    per_byte = lambda n, stride: priced(CLUSTER, "all_reduce", 1.0, np.array([n]), np.array([stride]))[1][0]  # noqa
    gb = OPTS.grad_bytes
    runs = {(dual, z): evaluate_config(TINY, CLUSTER, 16, 32, dataclasses.replace(DUAL, dualpipe=dual, sharding=z),
                                       OPTS) for dual in (0, 1) for z in (0, 1)}
    # zero 0: all-reduces; the pipeline sends are the same under both schedules, so the NVLink difference is the sync
    extra = runs[1, 0].link_busy_s["nvlink"] - runs[0, 0].link_busy_s["nvlink"]
    expected = gb * pair * per_byte(2, 1) + gb * pair / 2 * per_byte(2, 4) - gb * stage * per_byte(2, 1)
    assert extra == pytest.approx(expected, rel=1e-9)
    # the optimizer step: the rank's whole two stages (zero 0), their 1/(2·dp) shard (zero 1), against 1F1B's
    assert runs[1, 0].time_s["optimizer"] / runs[0, 0].time_s["optimizer"] == pytest.approx(pair / stage, rel=1e-12)
    assert runs[1, 1].time_s["optimizer"] / runs[0, 1].time_s["optimizer"] == pytest.approx(
        (pair / 4) / (stage / 2), rel=1e-12)
    # memory agrees: zero 1 shards the optimizer states over 2·dp = 4 ranks, zero 0 keeps them whole
    opt = OPTS.optimizer_bytes * pair
    assert runs[1, 0].memory_gb["optimizer"] == pytest.approx(opt / 1e9, rel=1e-12)
    assert runs[1, 1].memory_gb["optimizer"] == pytest.approx(opt / 4 / 1e9, rel=1e-12)


# ---- bad input ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fixed,batch,message", [
    ("dp=2,pp=3,dualpipe=1", 12, "even number of pipeline stages and an even number of micro-batches .* got pp=3 "
                                 "and 6 micro-batches"),
    ("dp=2,pp=4,micro_batch=1,dualpipe=1", 18, "got pp=4 and 9 micro-batches"),
    ("dp=2,pp=4,dualpipe=1", 12, "at least 2·pp = 8 micro-batches .* got 6"),
    ("dp=2,pp=4,vpp=2,dualpipe=1", 16, "no virtual stages .* got vpp=2"),
    ("dp=8,dualpipe=1", 16, "needs pipeline parallelism"),
])
def test_inconsistent_dualpipe_is_refused(fixed, batch, message):
    model = dataclasses.replace(TINY, layers=24)
    with pytest.raises(ValueError, match=message):
        ap.plan(model, "1x8:H100-80GB", global_batch_size=batch, seq_len=32, fixed=fixed)


def test_bad_dualpipe_values_are_typed_errors():
    with pytest.raises(ValueError, match="dualpipe must be one of 0\\|1, got 2"):
        parse_fixed("pp=2,dualpipe=2")
    with pytest.raises(ValueError, match="dualpipe must be among \\(0, 1\\), got \\[2\\]"):
        SearchSpace.from_constraints({"dualpipe": [2]})
    with pytest.raises(TypeError, match="dualpipe_memory"):      # one option: the schedule carries the memory
        PlannerOptions(dualpipe_memory=True)
    assert "dualpipe must be 0 or 1" in invalid_reason(TINY, 8, 16, 32, dataclasses.replace(DUAL, dualpipe=3), OPTS)


# ---- planner-only ------------------------------------------------------------------------------------------
def test_a_dualpipe_plan_says_it_is_planner_only():
    fixed = ap.plan(TINY, "1x8:H100-80GB", global_batch_size=16, seq_len=32, fixed="dp=2,pp=4,dualpipe=1")
    assert fixed.best.config.schedule == "DualPipe"
    assert ("Note: the configuration uses the DualPipe schedule (DeepSeek-AI 2024, arXiv:2412.19437 §3.2.1), priced "
            "but planner-only") in fixed.explanation
    plain = ap.plan(TINY, "1x8:H100-80GB", global_batch_size=16, seq_len=32, fixed="dp=2,pp=4")
    assert "planner-only" not in plain.explanation
    # the search proposes DualPipe only when asked for
    default = ap.plan(TINY, "1x8:H100-80GB", global_batch_size=16, seq_len=32, top=50, pp=[4])
    assert not any(c.config.dualpipe for c in default.candidates) and "planner-only" not in default.explanation
    asked = ap.plan(TINY, "1x8:H100-80GB", global_batch_size=16, seq_len=32, top=50, pp=[4], dualpipe=[0, 1])
    ranks = [i + 1 for i, c in enumerate(asked.candidates) if c.config.dualpipe]
    assert ranks and f"Note: candidate {', '.join(map(str, ranks))} uses the DualPipe schedule" in asked.explanation


def test_applying_a_dualpipe_plan_raises():
    with pytest.raises(NotImplementedError, match="DualPipe schedule .* runtime runs 1F1B or VPP only"):
        DUAL.to_strategy_dict(16)
    cand = evaluate_config(TINY, CLUSTER, 16, 32, DUAL, OPTS)
    with pytest.raises(NotImplementedError, match="DualPipe"):
        cand.to_strategy_dict()
    from autoparallel.planner.auto import to_strategy
    from autoparallel.strategy import Strategy

    with pytest.raises(NotImplementedError, match="DualPipe"):
        to_strategy(cand, Strategy())
    assert dataclasses.replace(DUAL, dualpipe=0).to_strategy_dict(16)["pipeline_parallel"]["schedule"] == "1F1B"


# ---- search ------------------------------------------------------------------------------------------------
def test_search_with_dualpipe_equals_exhaustive_enumeration():
    space = SearchSpace(dualpipe=(0, 1), vpp=(1, 2), sharding=(0, 1), offload=(0,), recompute=("none", "full"))
    opts = PlannerOptions(max_vpp=2)
    outcome = search(TINY, CLUSTER, 16, 32, space, opts)
    reference = exhaustive(TINY, CLUSTER, 16, 32, opts, space)
    best = outcome.top(1, 16, 32, H100.memory_bytes)[0]
    assert best.config == reference.config and best.step_time_s == reference.step_time_s
    g = outcome.grid
    shapes = {(int(p), int(v), int(16 // (d * b))) for p, v, d, b, on in
              zip(g["pp"], g["vpp"], g["dp"], g["mb"], g["dualpipe"]) if on}
    # (pp, vpp, micro-batches) on 8 GPUs, batch 16: at least 2·pp micro-batches, an even count, no vpp. pp 2: dp 4,
    # 2 or 1 (tp 1, 2, 4), 16/(dp·mb) in {16, 8, 4}; pp 4: dp 2 or 1, {8, 16} (4 < 2·4); pp 8: dp 1, mb 1, 16
    assert shapes == {(2, 1, 16), (2, 1, 8), (2, 1, 4), (4, 1, 8), (4, 1, 16), (8, 1, 16)}


def test_memory_floors_never_prune_a_dualpipe_plan_that_fits():
    """The search's memory floors bound DualPipe's per-rank memory from below: on a MoE model whose memory is tight
    (Mixtral-shaped, 64 H100, some plans fit and some do not), the pruned search keeps every plan that fits."""
    from autoparallel.planner.model_spec import PRESETS
    cluster, space = preset("H100-80GB", 8, 8), SearchSpace(dualpipe=(0, 1))
    pruned = search(PRESETS["mixtral-8x7b"], cluster, 1024, 4096, space, OPTS, prune=True)
    full = search(PRESETS["mixtral-8x7b"], cluster, 1024, 4096, space, OPTS, prune=False)
    fits = full.evaluation["feasible"]
    assert 0 < fits.sum() < len(fits)
    dual_fits = fits & (full.grid["dualpipe"] > 0)
    assert dual_fits.any() and ((full.grid["dualpipe"] > 0) & ~fits).any()
    assert len(pruned.evaluation["feasible"]) < len(fits)                  # the floors did prune
    assert pruned.evaluation["feasible"].sum() == fits.sum()
    best = lambda out: {k: int(out.grid[k][out.order[0]]) for k in out.grid}      # noqa: E731
    assert best(pruned) == best(full)


def test_deepseek_v3_row_runs_dualpipe_and_the_search_may_too():
    run = MOE_RUNS[0]
    assert run.config.dualpipe == 1 and run.config.schedule == "DualPipe"
    published = predict(run)
    as_1f1b = predict(dataclasses.replace(run, config=dataclasses.replace(run.config, dualpipe=0)))
    assert published.time_s["bubble"] < as_1f1b.time_s["bubble"]
    assert published.step_time_s < as_1f1b.step_time_s
    best = search_best(run, feasible_only=published.feasible)
    assert best.step_time_s <= published.step_time_s


def test_the_eager_runtime_profile_never_prices_dualpipe():
    """A calibrated CPU profile prices the runtime's own schedules: a fixed DualPipe plan is refused, and a search
    allowed to use it keeps to 1F1B / VPP."""
    from autoparallel.planner import calibrate
    from autoparallel.planner.cluster import RuntimeSpec

    rt = RuntimeSpec(op_s=0.0, dispatch_s=0.0, backward_s=0.0, optimizer_tensor_s=0.0)
    cluster = calibrate.cpu_profile(1e30, 1e30, 1e12, 4, runtime=rt)
    with pytest.raises(NotImplementedError, match="DualPipe is not priced for the eager runtime"):
        ap.plan(TINY, cluster, global_batch_size=8, seq_len=32, fixed="dp=2,pp=2,dualpipe=1")
    result = ap.plan(TINY, cluster, global_batch_size=8, seq_len=32, top=100, dualpipe=[0, 1])
    assert result.candidates and not any(c.config.dualpipe for c in result.candidates)
    assert any(c.config.pp == 2 for c in result.candidates)
