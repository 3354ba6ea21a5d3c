"""The planner against published large-scale training runs (outside Megatron-LM's Table 1, fitted on nothing):
each run's published configuration priced in fixed mode; errors, drift with scale, and the search's choice."""
import numpy as np
import pytest

from autoparallel.planner import published as P
from autoparallel.planner.model_spec import PRESETS


@pytest.fixture(scope="module")
def table():
    return P.validation_table(P.RUNS)


def test_at_least_eight_runs_with_sources():
    assert len(P.RUNS) >= 8
    assert len({r.model for r in P.RUNS}) >= 8                    # eight different models
    for run in P.RUNS + P.MOE_RUNS:
        assert run.source and run.published > 0 and run.model in PRESETS
        assert run.config.world == run.gpus


def test_predictions_against_published(table):
    errors = {r["name"]: r["ratio"] - 1 for r in table}
    within = [n for n, e in errors.items() if abs(e) <= 0.15]
    # achieved (docs/planner.md): 19 of 23 within 15% (the eight rows of MegaScale's 175B sweep all within 7%, its
    # three 530B weak-scaling points within 5%),
    # every run within 25% (the target of 15% for all is not met: GPT-NeoX-20B +21% and the three MT-NLG 530B rows
    # +18% to +23% are over-predicted, with DeepSpeed's stage messages partitioned over the TP group as its
    # engine sends them)
    assert len(within) >= 19, errors
    assert max(abs(e) for e in errors.values()) < 0.25, errors


def test_neox_tflops_are_counted_as_gpt_neox_counts_them():
    """GPT-NeoX's logger counted 6·params + 60·s·h·l FLOPs per token (no recomputation factor): the prediction
    is converted to that count, by hand for the 20B preset: 6·20,554,567,680 + 60·2048·6144·44 per token."""
    run = next(r for r in P.RUNS if r.name == "GPT-NeoX-20B")
    cand = P.predict(run)
    per_token = 6 * 20_554_567_680 + 60 * 2048 * 6144 * 44
    assert PRESETS[run.model].params == 20_554_567_680
    assert P.metric_of(run, cand) == pytest.approx(cand.tokens_per_s / 96 * per_token / 1e12, rel=1e-12)
    # negative control: Megatron's count (recomputation included) is 8.7% larger for the same step time
    megatron = cand.tflops_per_device
    assert megatron / P.metric_of(run, cand) == pytest.approx(170_168_156_160 / per_token, rel=1e-6)


def test_deepspeed_pipeline_transfers_are_serial():
    """DeepSpeed's TrainSchedule puts two blocking transfers in every step of an interior stage: the pipeline
    sends on the critical path double (by hand: 4·(m + p - 1) for p > 2), and nothing else changes."""
    from dataclasses import replace as dc_replace

    from autoparallel.planner.cost_model import pp_sends_per_step

    assert pp_sends_per_step(np.array([35]), 1, np.array([240]), serial=True)[0] == 4 * (240 + 34)
    assert pp_sends_per_step(np.array([2]), 1, np.array([8]), serial=True)[0] == 2 * (8 + 1)   # no interior stage
    run = next(r for r in P.RUNS if r.name == "MT-NLG 530B (2240)")
    serial = P.predict(run)
    batched = P.predict(dc_replace(run, software=tuple(kv for kv in run.software if kv[0] != "pp_serial_p2p")))
    assert serial.time_s["pp_comm"] == pytest.approx(2 * batched.time_s["pp_comm"], rel=1e-9)
    others = [k for k in serial.time_s if k != "pp_comm"]
    assert [serial.time_s[k] for k in others] == pytest.approx([batched.time_s[k] for k in others], rel=1e-12)


def test_deepspeed_pipeline_messages_are_partitioned_over_the_tp_group():
    """DeepSpeed's engine sends 1/tp of each activation and gradient per rank (PartitionedTensor over the TP
    group): by hand for MT-NLG on 2,240 GPUs, 4·(240 + 34) transfers of 2048·20480·2 bytes / 8 on each GPU's
    own 200 Gb/s rail at 90% of line rate; the whole message (negative control) costs 8x the network time."""
    from dataclasses import replace as dc_replace

    run = next(r for r in P.RUNS if r.name == "MT-NLG 530B (2240)")
    assert all(dict(r.software).get("pp_scatter_gather") for r in P.RUNS if dict(r.software).get("pp_serial_p2p"))
    part = P.predict(run)
    whole = P.predict(dc_replace(run, software=tuple(kv for kv in run.software if kv[0] != "pp_scatter_gather")
                                 + (("pp_scatter_gather", False),)))
    calls, msg, rail = 4 * (240 + 34), 2048 * 20480 * 2, 25e9 * 0.9
    saved = whole.link_busy_s["network"] - part.link_busy_s["network"]
    assert saved == pytest.approx(calls * msg * (1 - 1 / 8) / rail, rel=1e-9)
    assert part.time_s["pp_comm"] < whole.time_s["pp_comm"] / 4
    others = [k for k in part.time_s if k != "pp_comm"]
    assert [part.time_s[k] for k in others] == pytest.approx([whole.time_s[k] for k in others], rel=1e-12)


def test_gpt_1t_first_stage_by_korthikanti():
    """The 1T row's first stage, term by term as Korthikanti et al. count it: Megatron-LM's 18 bytes per parameter
    without the distributed optimizer (bf16 weight 2, fp32 main_grad 4, fp32 master + Adam m, v 12;
    megatron/training/theoretical_memory_usage.py), 34·s·b·h/t per block for p micro-batches of L/p blocks
    (Eq. 6), the embedding mask s·b·h·p/t (§4.3) and one block's rebuilt scores 5·a·s²·b/t. Not interleaved (§6),
    it fits; interleaved with v = 2 (what the row assumed before) the paper's own formula exceeds 80 GB even with
    no reserve, so the run that ran cannot have been interleaved."""
    from dataclasses import replace as dc_replace

    run = next(r for r in P.RUNS if r.name == "GPT 1T (SP+selective)")
    h, s, t, p, L, V, a = 25600, 2048, 8, 64, 128, 51200, 160
    block = (12 * h * h + 7 * h) / t + 6 * h              # TP-split matrices and q/k/v/fc1 biases, replicated rest
    psi = 2 * block + V * h / t + s * h                   # two blocks, vocabulary-parallel embedding, positions
    assert psi == 2_182_700_800
    sbh_t = s * h / t
    blocks, mask, scores = 34 * sbh_t * L, sbh_t * p, 5 * a * s * s / t
    cand = P.predict(run)
    mem = cand.memory_gb
    assert (mem["params"] + mem["grads"] + mem["optimizer"]) * 1e9 == pytest.approx(18 * psi, rel=1e-12)
    assert mem["activations"] * 1e9 == pytest.approx(blocks + mask + scores, rel=1e-12)
    assert cand.feasible and cand.memory_per_device_gb == pytest.approx(18 * psi / 1e9 + 29.360128 + 8.0, rel=1e-9)
    interleaved = 18 * psi + (blocks + mask) * (1 + (p - 1) / (p * 2))
    assert interleaved / 1e9 == pytest.approx(82.47, abs=0.01) and interleaved > 80e9
    assert not P.predict(dc_replace(run, config=dc_replace(run.config, vpp=2))).feasible


def test_korthikanti_runs_as_the_paper_states_them():
    """Table 3 micro-batch sizes (22B: 4, others 1) and §6's interleaving (m = 3 for 175B and 530B only)."""
    rows = {r.name: r.config for r in P.RUNS if "SP+selective" in r.name}
    assert [(c.micro_batch, c.vpp) for c in rows.values()] == [(4, 1), (1, 3), (1, 3), (1, 1)]


def test_llama3_rows_as_section_3_3_2_states_them():
    """Dubey et al. §3.3.2: no activation checkpointing, FSDP sharding optimizer states and gradients (ZeRO-2), one
    block fewer on the end stages with one block per chunk (V = 8). The fullest stage (a middle one, 8 blocks) keeps,
    by Megatron-LM's interleaved count for the second stage, 15·(1 + 14/120) micro-batches of a SwiGLU/GQA block's
    31.75·s·b·h/t bytes (FlashAttention): 71.38 GB, so the row still does not fit 80 GB (Meta's own in-flight count,
    with its tunable N, is not published)."""
    for run in (r for r in P.RUNS if r.model == "llama3-405b"):
        c = run.config
        assert (c.vpp, c.split, c.sharding, c.recompute, c.sp) == (8, "ends", 2, "none", 1)
        s, h, t, f, kv = 8192, 16384, 8, 53248, 1024
        per_block = (8 + 2 + 4 * kv / h + 2 + 6 * f / h) * s * h / t
        assert per_block == 532_676_608
        cand = P.predict(run)
        assert cand.memory_gb["activations"] * 1e9 == pytest.approx(8 * per_block * 15 * (1 + 14 / 120), rel=1e-12)
        assert not cand.feasible


def test_no_drift_with_scale(table):
    slope = P.drift(table)                                        # ratio change per doubling of the GPU count
    assert abs(slope) < 0.01
    small = [r["ratio"] for r in table if r["gpus"] <= 512]
    large = [r["ratio"] for r in table if r["gpus"] >= 2048]
    assert abs(np.mean(small) - np.mean(large)) < 0.10


def test_a_wrong_model_is_caught():
    # negative control: a cost model with half the matmul efficiency misses every run by far
    half = P.validation_table(P.RUNS[:3], P.PlannerOptions(gemm_efficiency=0.33))
    assert all(r["ratio"] < 0.8 for r in half)


@pytest.mark.parametrize("run", P.RUNS, ids=[r.name for r in P.RUNS])
def test_search_is_at_least_as_fast_as_the_published_configuration(run):
    published = P.predict(run)
    best = P.search_best(run, feasible_only=published.feasible)
    assert best is not None
    assert best.step_time_s <= published.step_time_s * (1 + 1e-12), (best.config.short(), published.config.short())


def test_moe_run_is_priced():
    row = P.validation_table(P.MOE_RUNS)[0]
    assert 0.4 < row["ratio"] < 2.5                               # reported in docs/planner.md (see there)


# ---- MegaScale's strong-scaling sweep of a 175B model, Megatron-LM rows (Jiang et al. 2024, Table 2) ----------
# (GPUs, global batch, throughput tokens/s, MFU) as the paper's Table 2 prints them
MEGASCALE_TABLE_2 = ((256, 768, 39.3e3, 0.530), (512, 768, 74.1e3, 0.499), (768, 768, 103.8e3, 0.467),
                     (1024, 768, 132.7e3, 0.447), (3072, 6144, 433.6e3, 0.487), (6144, 6144, 851.6e3, 0.478),
                     (8192, 6144, 1027.9e3, 0.433), (12288, 6144, 1466.8e3, 0.412))


@pytest.fixture(scope="module")
def sweep():
    return P.validation_table(P.MEGASCALE_SWEEP)


def test_megascale_sweep_rows_are_the_papers():
    """Eight rows, TP 8 x PP 8 with 6 interleaved stages (Table 1, §6.1), DP = GPUs / 64, the two batch sizes."""
    assert [(r.gpus, r.global_batch, r.published) for r in P.MEGASCALE_SWEEP] == \
        [(g, b, m) for g, b, _, m in MEGASCALE_TABLE_2]
    for run in P.MEGASCALE_SWEEP:
        assert (run.config.tp, run.config.pp, run.config.vpp, run.config.dp) == (8, 8, 6, run.gpus // 64)
        assert run.config.num_micro_batches(run.global_batch) % 8 == 0    # Megatron's interleaving needs m % pp == 0
        assert run in P.RUNS
    model = PRESETS["megascale-175b"]
    assert (model.hidden, model.layers, model.heads, model.vocab, model.ffn) == (12288, 96, 128, 64000, 4 * 12288)


def test_megascale_mfu_is_counted_as_the_planner_counts_it():
    """The paper's MFU column follows from its throughput column with the planner's FLOPs per token, by hand
    Megatron's 72·l·h²·(1 + s/6h + V/12hl) per token (no recomputation), on a 312 TFLOP/s peak (A100/A800 bf16):
    the same count, so no conversion (``flop_counter``). Negative control: 6·params per token (no attention
    term) gives 51.8% for the 256-GPU row's 53.0%."""
    model = PRESETS["megascale-175b"]
    l, h, s, v = 96, 12288, 2048, 64000
    per_token = 72 * l * h * h * (1 + s / (6 * h) + v / (12 * h * l))
    assert model.model_flops_per_token(2048) == pytest.approx(per_token, rel=1e-12)
    for gpus, _, tokens_per_s, mfu in MEGASCALE_TABLE_2:
        assert tokens_per_s * per_token / (gpus * 312e12) == pytest.approx(mfu, abs=0.001)
    six_n = 6 * model.params
    assert abs(39.3e3 * six_n / (256 * 312e12) - 0.530) > 0.01


def test_megascale_sweep_predictions(sweep):
    """Published vs predicted MFU, every row within the 15% target. Achieved (docs/planner.md, "The 175B scaling
    sweep"): 49.5/48.4/47.3/46.2% on 256-1024 GPUs (published 53.0/49.9/46.7/44.7), 48.7/46.9/45.7/43.4% on
    3072-12,288 (published 48.7/47.8/43.3/41.2); ratios 0.934 to 1.056, every configuration fits in memory."""
    for row in sweep:
        assert abs(row["ratio"] - 1) <= 0.15, row
        assert row["feasible"], row
    assert min(r["ratio"] for r in sweep) > 0.9 and max(r["ratio"] for r in sweep) < 1.1


def test_megascale_sweep_drift_is_pinned(sweep):
    """The planner's MFU falls with scale more slowly than the sweep's (observed, not fixed):
    +0.015 per doubling over 256-12,288 GPUs, +0.051 (batch 768) and +0.031 (batch 6144) per doubling within
    one batch size. Published MFU falls 16% from 256 to 1024 GPUs and 15% from 3072 to 12,288; predicted 7% and 11%."""
    by_batch = {b: [r for r, run in zip(sweep, P.MEGASCALE_SWEEP) if run.global_batch == b] for b in (768, 6144)}
    assert 0 < P.drift(sweep) < 0.02
    assert 0.03 < P.drift(by_batch[768]) < 0.07 and 0.02 < P.drift(by_batch[6144]) < 0.05
    for rows in by_batch.values():
        published_fall = rows[-1]["published"] / rows[0]["published"]
        predicted_fall = rows[-1]["predicted"] / rows[0]["predicted"]
        assert published_fall < predicted_fall < 1


# ---- MegaScale's weak scaling of a 530B model, Megatron-LM points (Jiang et al. 2024, Figure 9) ----------------
def test_megascale_530b_rows_are_the_papers():
    """Three points, TP 8 x PP 35 with 3 interleaved stages (Table 1, §6.1), batch = GPUs, so 280 micro-batches
    of one sequence per pipeline at every scale; the model has 160 heads of 128 (Table 1)."""
    assert [(r.gpus, r.global_batch, r.published) for r in P.MEGASCALE_530B] == \
        [(2240, 2240, 0.492), (4480, 4480, 0.488), (11200, 11200, 0.482)]
    for run in P.MEGASCALE_530B:
        assert (run.config.tp, run.config.pp, run.config.vpp, run.config.dp) == (8, 35, 3, run.gpus // 280)
        assert run.config.num_micro_batches(run.global_batch) == 280 and run in P.RUNS
    model = PRESETS["megascale-530b"]
    assert (model.hidden, model.layers, model.heads, model.vocab) == (20480, 105, 160, 64000)


def test_megascale_530b_predictions():
    """Published vs predicted MFU: every point within 15% and feasible. Achieved (docs/planner.md): 50.5 / 50.5 /
    50.5% against 49.2 / 48.8 / 48.2% (ratios 1.027, 1.035, 1.047): with m fixed at 280 the model's step barely
    changes with dp, while the paper reports the 1-point fall it puts down to stragglers and communication."""
    rows = P.validation_table(P.MEGASCALE_530B)
    for row in rows:
        assert abs(row["ratio"] - 1) <= 0.15 and row["feasible"], row
    assert [round(r["ratio"], 3) for r in rows] == sorted(round(r["ratio"], 3) for r in rows)   # rises with scale
    assert max(r["predicted"] for r in rows) - min(r["predicted"] for r in rows) < 0.002
