"""Search: equal to exhaustive enumeration, deterministic, constraints, fixed configurations, infeasibility."""
import time

import pytest

import autoparallel as ap
from autoparallel.planner.cluster import parse_cluster, preset
from autoparallel.planner.config import ParallelConfig, parse_fixed
from autoparallel.planner.model_spec import ModelSpec, parse_model
from autoparallel.planner.options import PlannerOptions
from autoparallel.planner.search import (SearchSpace, build_grid, config_at, enumerate_valid, exhaustive, search)

OPTS = PlannerOptions(max_vpp=4)

# (model, cluster, global batch, seq len): small enough to enumerate; memory binds in some of them
CASES = [
    (parse_model("hidden=1024,layers=8,heads=16,vocab=32000,seq=1024"), preset("A100-40GB", 1, 8), 16, 1024),
    (parse_model("gpt3-1.3b"), preset("A100-40GB", 1, 4), 8, 2048),
    (ModelSpec("gqa", 2048, 12, 16, 32000, ffn=5632, kv_heads=4, seq_len=2048, swiglu=True, bias=False,
               layernorm=False, tied_embeddings=False, learned_positions=False, dropout=False),
     preset("H100-80GB", 2, 4), 8, 4096),
    (parse_model("llama2-7b"), preset("A100-40GB", 2, 2), 4, 4096),
]


def _configs(grid):
    return {config_at(grid, i) for i in range(len(grid["dp"]))}


_EXHAUSTIVE = {}


def _exhaustive(model, cluster, batch, seq):
    """``exhaustive`` of a case, once per session (the negative control reuses the first case's)."""
    key = (model.name, cluster.name, batch, seq)
    if key not in _EXHAUSTIVE:
        _EXHAUSTIVE[key] = exhaustive(model, cluster, batch, seq, OPTS)
    return _EXHAUSTIVE[key]


@pytest.mark.parametrize("model,cluster,batch,seq", CASES, ids=[c[0].name + "@" + c[1].name for c in CASES])
def test_search_equals_exhaustive_enumeration(model, cluster, batch, seq):
    grid = build_grid(model, cluster.world_size, batch, seq, SearchSpace(), OPTS)
    assert _configs(grid) == set(enumerate_valid(model, cluster.world_size, batch, seq, OPTS))
    outcome = search(model, cluster, batch, seq, SearchSpace(), OPTS)
    reference = _exhaustive(model, cluster, batch, seq)
    if reference is None:
        assert len(outcome.order) == 0
        return
    best = outcome.top(1, batch, seq, cluster.device.memory_bytes)[0]
    assert best.config == reference.config
    assert best.step_time_s == reference.step_time_s


def test_some_cases_are_memory_bound():
    # the exactness cases must exercise feasibility, not only timing
    bound = 0
    for model, cluster, batch, seq in CASES:
        outcome = search(model, cluster, batch, seq, SearchSpace(), OPTS)
        bound += int((~outcome.evaluation["feasible"]).any())
    assert bound >= 2


def test_deterministic():
    a = ap.plan("llama2-13b", "4x8:A100-80GB", global_batch_size=256, seq_len=4096, top=8).to_dict()
    b = ap.plan("llama2-13b", "4x8:A100-80GB", global_batch_size=256, seq_len=4096, top=8).to_dict()
    a.pop("planning_seconds"), b.pop("planning_seconds")
    assert a == b
    steps = [c["step_time_s"] for c in a["candidates"]]
    assert steps == sorted(steps)


def test_plan_result_shape_and_json():
    result = ap.plan("llama2-7b", "1x8:A100-80GB", global_batch_size=64, seq_len=4096, top=3)
    assert result.feasible and len(result.candidates) == 3
    best = result.best.to_dict()
    for key in ("dp", "tp", "pp", "vpp", "sp", "sharding_stage", "recompute", "offload", "micro_batch_size",
                "num_micro_batches", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu",
                "memory_per_device_gb", "feasible"):
        assert key in best
    assert best["dp"] * best["tp"] * best["pp"] == 8
    assert best["dp"] * best["micro_batch_size"] * best["num_micro_batches"] == 64
    assert best["memory_per_device_gb"] <= 80.0
    assert '"candidates"' in result.to_json()
    text = str(result)
    assert "Why #1" in text and "step s" in text


def test_constraints_restrict_the_search():
    result = ap.plan("llama2-7b", "1x8:A100-80GB", global_batch_size=64, seq_len=4096, tp=[2],
                     recompute="full", offload=[0])
    for c in result.candidates:
        assert c.config.tp == 2 and c.config.recompute == "full" and c.config.offload == 0
    with pytest.raises(ValueError, match="unknown search constraint"):
        ap.plan("llama2-7b", "1x8:A100-80GB", global_batch_size=64, colour=[1])


def test_fixed_configuration_with_defaults():
    result = ap.plan("llama2-7b", "1x8:A100-80GB", global_batch_size=64, seq_len=4096,
                     fixed="tp=2,recompute=selective,sharding=1")
    assert result.mode == "fixed" and len(result.candidates) == 1
    c = result.candidates[0].config
    assert c == ParallelConfig(dp=4, tp=2, pp=1, vpp=1, sp=0, sharding=1, recompute="selective", offload=0,
                               micro_batch=1)
    assert result.reference is not None
    assert result.reference.step_time_s <= result.candidates[0].step_time_s


def test_fixed_on_part_of_the_cluster():
    result = ap.plan("llama2-70b", "128x8:A100-80GB", global_batch_size=1536, seq_len=4096,
                     fixed="dp=4,tp=8,pp=4,micro_batch=1,recompute=selective,sharding=1")
    assert result.cluster.world_size == 128
    assert "128 of the 1024 devices" in result.explanation


@pytest.mark.parametrize("fixed,match", [
    ("dp=3", "not divisible"), ("tp=8,foo=1", "unknown fixed key"), ("sp=2", "sp must be one of"),
    ("recompute=some", "recompute must be one of"), ("tp", "malformed"), ("tp=3", "does not divide"), ("tp=8,dp=1,pp=1,sp=1,micro_batch=3", "not divisible"),
    ("dp=16,tp=8", "devices"), ("vpp=2", "needs pipeline"), ("sharding=1,dp=1,tp=8", "needs dp > 1"),
    ("dp=2,tp=1,pp=4,micro_batch=4", "4-stage pipeline needs at least 4 micro-batches per step"),
])
def test_fixed_errors(fixed, match):
    with pytest.raises(ValueError, match=match):
        ap.plan("llama2-7b", "1x8:A100-80GB", global_batch_size=16, seq_len=4096, fixed=fixed)


def test_every_pipeline_candidate_runs_at_least_pp_micro_batches():
    """What the runtime's 1F1B runs: m >= pp. A batch of 8 on 8 devices leaves pipelines of 2, 4 and 8 stages
    with 8 // dp micro-batches each; the search keeps only those with m >= pp, and fixed mode names the rule."""
    result = ap.plan("llama2-7b", "1x8:A100-80GB", global_batch_size=8, seq_len=4096, top=10 ** 6)
    pipelines = [c for c in result.candidates if c.config.pp > 1]
    assert pipelines and all(c.num_micro_batches >= c.config.pp for c in pipelines)
    assert {c.config.pp for c in pipelines} >= {2, 4}
    ok = ap.plan("llama2-7b", "1x8:A100-80GB", global_batch_size=8, seq_len=4096, fixed="dp=2,tp=1,pp=4,micro_batch=1")
    assert ok.best.num_micro_batches == 4                         # the boundary m == pp is allowed


def test_parse_fixed():
    assert parse_fixed("dp=4, tp=8,recompute=full") == {"dp": 4, "tp": 8, "recompute": "full"}
    with pytest.raises(ValueError, match="must be a positive integer"):
        parse_fixed("micro_batch=0")


def test_infeasible_search_names_more_devices():
    result = ap.plan("llama3-405b", "1x8:A100-40GB", global_batch_size=16)   # batch 8: no pipeline has pp micro-batches
    assert not result.feasible and not result.candidates
    assert "smallest change that fits" in result.explanation
    assert result.suggestions and "nodes" in result.suggestions[0]["change"]


def test_infeasible_constraint_is_relaxed_first():
    result = ap.plan("llama2-7b", "1x8:A100-40GB", global_batch_size=8, seq_len=4096, recompute="none",
                     sharding=[0], offload=[0], tp=[1])
    assert not result.feasible
    assert result.suggestions[0]["change"].startswith("allow any")


def test_infeasible_fixed_names_smallest_change():
    result = ap.plan("llama2-7b", "1x8:A100-80GB", global_batch_size=16, seq_len=4096, fixed="micro_batch=2")
    assert not result.feasible
    first = result.suggestions[0]
    assert first["memory_per_device_gb"] <= 80.0
    assert "smallest change that fits: " + first["change"] in result.explanation


def test_batch_that_no_data_parallel_degree_divides():
    tiny = "hidden=256,layers=2,heads=2,vocab=1000,seq=128"
    with pytest.raises(ValueError, match="must divide the global batch"):
        ap.plan(tiny, "2x8:A100-80GB", global_batch_size=3)


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown model"):
        ap.plan("gpt5", "1x8:A100-80GB", global_batch_size=8)
    with pytest.raises(ValueError, match="unknown device"):
        ap.plan("llama2-7b", "1x8:V100", global_batch_size=8)
    with pytest.raises(ValueError, match="zero devices"):
        parse_cluster("0x8:A100-80GB")
    with pytest.raises(ValueError, match="positive integer"):
        ap.plan("llama2-7b", "1x8:A100-80GB", global_batch_size=0)
    with pytest.raises(ValueError, match="divisible by heads"):
        parse_model("hidden=100,layers=2,heads=3,vocab=10")


def test_presets():
    assert parse_model("llama2-70b").params == pytest.approx(68.98e9, rel=1e-3)
    assert parse_model("llama3-8b").params == pytest.approx(8.03e9, rel=1e-3)
    assert parse_model("llama3-405b").params == pytest.approx(405.8e9, rel=1e-3)
    assert parse_model("megatron-1t").params == pytest.approx(1008.0e9, rel=1e-3)
    assert parse_model("megatron-145b").params == pytest.approx(145.6e9, rel=2e-3)
    assert parse_model("gpt3-175b").params == pytest.approx(174.6e9, rel=1e-3)
    custom = parse_model("hidden=8192,layers=48,heads=64,vocab=51200,kv_heads=8,ffn=28672,swiglu=1")
    assert custom.kv_heads == 8 and custom.ffn == 28672 and custom.swiglu and not custom.bias
    with pytest.raises(TypeError, match="paddle.nn.Layer"):
        ModelSpec.from_trace(None, seq_len=16, batch=2)
    with pytest.raises(ValueError, match="seq_len"):
        ModelSpec.from_trace(None, seq_len=0, batch=2)


def test_llama2_70b_on_1024_gpus_is_fast():
    # a guard against accidental blow-ups (the benchmark in tools/bench_planner.py reports the figure)
    start = time.perf_counter()
    result = ap.plan("llama2-70b", "128x8:A100-80GB", global_batch_size=1536, seq_len=4096)
    assert result.feasible and time.perf_counter() - start < 10.0


def test_negative_control_a_missing_knob_value_is_detected():
    # the same comparison must fail when the generated space silently drops a value
    model, cluster, batch, seq = CASES[0]
    full = set(enumerate_valid(model, cluster.world_size, batch, seq, OPTS))
    partial = _configs(build_grid(model, cluster.world_size, batch, seq, SearchSpace(sp=(0,)), OPTS))
    assert partial != full and partial < full
    reference = _exhaustive(model, cluster, batch, seq)
    others = tuple(z for z in range(4) if z != reference.config.sharding)
    crippled = search(model, cluster, batch, seq, SearchSpace(sharding=others), OPTS)
    assert crippled.top(1, batch, seq, 1)[0].config != reference.config


def test_candidates_convert_to_a_strategy():
    strategy = pytest.importorskip("autoparallel.strategy")
    result = ap.plan("llama2-70b", "16x8:A100-80GB", global_batch_size=256, seq_len=4096, top=5)
    for cand in result.candidates:
        s = strategy.Strategy.from_dict(cand.to_strategy_dict())
        assert s.num_micro_batches == cand.num_micro_batches
        assert s.tensor_parallel.degree == cand.config.tp and s.pipeline_parallel.degree == cand.config.pp
