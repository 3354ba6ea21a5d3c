"""The eager planner (auto_mode="full") proposes ZeRO-1/2 inside pipeline stages, as the runtime runs it
(parallel/pipeline/zero.py): every configuration of its search space passes the runtime's own checks; the ZeRO
terms are priced per stage over the stage's data ranks (hand-computed); a memory budget that needs sharded optimizer
states makes it pick PP+ZeRO; and the PP+ZeRO-1 it picks trains like one process in the simulated world."""
import dataclasses
import types

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel import entry_points as ep
from autoparallel.parallel.model_families import model_info
from autoparallel.parallel.pipeline.wiring import _check_composable
from autoparallel.parallelize import check_supported
from autoparallel.planner import auto
from autoparallel.planner.api import plan
from autoparallel.planner.calibrate import cpu_profile
from autoparallel.planner.config import ParallelConfig
from autoparallel.planner.cluster import CollectiveFit, RuntimeSpec
from autoparallel.planner.model_spec import ModelSpec
from autoparallel.planner.model_read import allowed_tp
from autoparallel.planner.options import options_for_cluster
from autoparallel.planner.search import SearchSpace, build_grid, config_at

from models import PRESETS, build  # noqa: E402

SMALL = dataclasses.replace(PRESETS["gpt-tiny"], vocab_size=256, layers=4)       # tp 1/2/4, pp 1/2/4
# heads=3: no tensor parallelism on 4 or 8 ranks; a 2048-token vocabulary makes the embedding and the LM head
# most of the parameters, so a stage of a two-stage pipeline holds half the weights of the whole model
WIDE = dataclasses.replace(PRESETS["gpt-tiny"], vocab_size=2048, hidden=48, heads=3, layers=2)
H, V, S = 48, 2048, 16
BLOCK = 12 * H * H + 13 * H                    # GPT block: qkv, proj, fc1, fc2 (+ biases), two LayerNorms
PSI_FIRST = BLOCK + V * H + S * H             # the first stage: one block, token and position embeddings
PSI_LAST = BLOCK + 2 * H + H * V               # the last stage: one block, the final norm, the LM head
TENSORS_LAST = 12 + 5                          # parameter tensors the planner counts on that stage
# one fp32 block (Korthikanti), the fp32 logits, and the final norm's and LM head's fp32 inputs (Korthikanti §4.3)
ACT_LAST = 2 * S * H * (8 + 24) + 2 * 2 * 3 * S * S + 4 * S * V + 2 * 4 * S * H


def profile(per_rank_bytes, ranks=8, **latency):
    """A CPU profile: every collective 1 ms + bytes/1e12 (``latency`` overrides, e.g. reduce_scatter/4),
    send/recv 0.1 ms, ``per_rank_bytes`` of device memory per rank."""
    fits = [CollectiveFit(name, n, latency.get(f"{name}/{n}", 1e-3), 1e12)
            for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast") for n in (2, 4, 8)]
    fits.append(CollectiveFit("send_recv", 2, 1e-4, 1e12))
    rt = RuntimeSpec(op_s=1e-6, dispatch_s=5e-5, backward_s=2e-5, optimizer_tensor_s=2e-5, recompute_s=1e-3)
    return cpu_profile(2e10, 8e10, per_rank_bytes * ranks, ranks, collectives=tuple(fits), runtime=rt)


def full(batch=8):
    s = ap.Strategy()
    s.auto_mode = "full"
    s.global_batch_size = batch
    return s


def strategy_of(config, batch=8):
    """What auto_mode='full' hands ap.parallelize for ``config`` (planner/auto.py's to_strategy)."""
    return auto.to_strategy(types.SimpleNamespace(to_strategy_dict=lambda: config.to_strategy_dict(batch)), full(batch))


def runtime_accepts(chosen, world, info):
    """The runtime's own checks, called here directly (not through the planner): ap.parallelize's entry-point,
    Strategy.validate and check_supported, and apply_pp's _check_composable for pipelines."""
    ep.reject_unsupported(chosen, ep.PARALLELIZE)
    degrees = chosen.validate(world_size=world, model_info=info)
    check_supported(chosen, None, degrees)
    if degrees.pp > 1:
        _check_composable(chosen, degrees)
    return degrees


def eager_space(model, world, batch=8, seq=16):
    """Every configuration of every search auto_mode='full' runs for ``model`` on ``world`` CPU ranks."""
    spec = ModelSpec.from_trace(model, seq, 1)
    cluster = profile(1e9, world)
    tps = [tp for tp, why in allowed_tp(model, world).items() if why is None]
    out = []
    for constraints in auto._searches(world, spec.layers, auto._pipeline_ok(model), True, auto._selective_ok(model)):
        space = SearchSpace.from_constraints(dict({"tp": tps}, **constraints))
        grid = build_grid(spec, world, batch, seq, space, options_for_cluster(cluster, None))
        out += [config_at(grid, i) for i in range(len(grid["dp"]))]
    return out


@pytest.mark.parametrize("world", [4, 8])
def test_every_eager_candidate_passes_the_runtime_checks(world):
    model = build(SMALL, lazy=True)
    info = model_info(model)
    configs = eager_space(model, world)
    zero_in_stages = {c.sharding for c in configs if c.pp > 1 and c.sharding}
    assert zero_in_stages == {1, 2}, "the space must hold PP with ZeRO-1 and ZeRO-2 (dp > 1 inside the stages)"
    assert all(c.dp > 1 for c in configs if c.sharding), "ZeRO shards over a stage's data ranks: dp > 1"
    refused = []
    for c in configs:
        try:
            runtime_accepts(strategy_of(c), world, info)
        except (ValueError, NotImplementedError) as e:
            refused.append(f"{c.short()}: {e}")
    assert refused == [], refused[:3]
    assert len(configs) > 100
    # negative control: the same checks refuse what the runtime refuses (PP+ZeRO-3, ZeRO on one-rank stages)
    z3 = next(c for c in configs if c.pp > 1 and c.sharding == 2)
    for bad, error in ((dataclasses.replace(z3, sharding=3), NotImplementedError),
                       (dataclasses.replace(z3, dp=1, tp=1, pp=world, sharding=1), ValueError)):
        with pytest.raises(error):
            runtime_accepts(strategy_of(bad), world, info)
        assert auto.runtime_refusal(strategy_of(bad), world, info) is not None


def test_the_pp_zero_candidates_build_in_the_simulated_world():
    """Beyond the dry checks: each PP+ZeRO configuration of the 4-rank space builds through ap.parallelize (stages,
    sub-meshes and one ZeRO optimizer per stage sub-mesh); nothing is trained."""
    from autoparallel.parallel.pipeline.zero import PipelineZeroOptimizer

    shapes = sorted({(c.dp, c.tp, c.pp, c.vpp, c.sp, c.sharding, c.micro_batch) for c in
                     eager_space(build(SMALL, lazy=True), 4) if c.pp > 1 and c.sharding})
    assert shapes
    for dp, tp, pp, vpp, sp, zero, mb in shapes[:4]:
        c = ParallelConfig(dp=dp, tp=tp, pp=pp, vpp=vpp, sp=sp, sharding=zero, micro_batch=mb)
        with ap.simulate(world_size=4):
            model = build(SMALL)
            opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
            _, opt = ap.parallelize(model, opt, strategy=strategy_of(c))
            assert isinstance(opt, PipelineZeroOptimizer) and len(opt.zeros) == pp


def test_zero_in_stages_is_priced_over_each_stage_s_data_ranks():
    """PP2 x DP4 on 8 ranks: the ZeRO terms use a stage's parameters Ψ (not the model's) and its 4 data ranks.
    Time: the stage with most parameters (the first, Ψ = 127344); memory: the stage that needs most (the last, with
    the fp32 logits, Ψ = 126672). Hand-computed: ZeRO-1 adds one all_gather of the updated chunks over the stage's
    4 data ranks, 1 ms + 4Ψ/4 bytes at 1e12 B/s; ZeRO-2
    turns the bucket all_reduce (1 ms) into a reduce_scatter (3 ms here) besides; memory per rank is the eager
    runtime's bookkeeping with d = 4 (fp32 weights 4Ψ, gradients 4Ψ (+ ZeRO-1's master gradient 4Ψ/4), AdamW's
    moments 8Ψ/d, ZeRO's fp32 master chunk 4Ψ/4, 8 bytes of beta powers per tensor)."""
    spec = ModelSpec.from_trace(build(WIDE, lazy=True), S, 1)
    cluster = profile(1e9, **{"reduce_scatter/4": 3e-3})
    got = {z: plan(spec, cluster, 8, S, fixed=f"pp=2,dp=4,sharding={z},micro_batch=1").candidates[0]
           for z in (0, 1, 2)}
    assert (PSI_FIRST, PSI_LAST) == (127344, 126672) and PSI_FIRST + PSI_LAST == spec.params
    psi, d, beta = PSI_LAST, 4, 8 * TENSORS_LAST
    gather = 1e-3 + 4 * PSI_FIRST / d / 1e12
    assert got[1].time_s["dp_comm"] - got[0].time_s["dp_comm"] == pytest.approx(gather, rel=1e-9)
    assert got[2].time_s["dp_comm"] - got[0].time_s["dp_comm"] == pytest.approx(gather + 2e-3, rel=1e-9)
    want = {0: (4 * psi, 4 * psi, 8 * psi + beta),
            1: (4 * psi, 4 * psi + 4 * psi / d, 8 * psi / d + 4 * psi / d + beta),
            2: (4 * psi, 4 * psi, 8 * psi / d + 4 * psi / d + beta)}
    for z, (params, grads, opt) in want.items():
        m = got[z].memory_gb
        assert (m["params"] * 1e9, m["grads"] * 1e9, m["optimizer"] * 1e9) == pytest.approx((params, grads, opt))
        assert m["activations"] * 1e9 == pytest.approx(ACT_LAST)


def test_memory_bound_choice_is_pp_with_zero():
    """1.8 MB per rank on 8 ranks (10% reserved: 1.62 MB usable). Hand figures, bytes:
    * every pp=1 plan (dp=8; heads=3 allows no tp) holds the whole model's fp32 weights, 4·254016 = 1016064, even
      under ZeRO-1/2, plus at least ZeRO-2's gradient and optimizer chunks and the fp32 logits: > 1.62 MB;
    * PP2 x DP4 without ZeRO: 16Ψ + beta powers + activations = 2216328 > 1.62 MB;
    * PP2 x DP4 ZeRO-1: 12Ψ + ... = 1709640 > 1.62 MB (the master copy and its gradient eat the savings);
    * PP2 x DP4 ZeRO-2: 11Ψ + ... = 1582968 fits.  (ZeRO-3 on dp=8 fits too but pays per-layer gathers.)"""
    psi, beta = PSI_LAST, 8 * TENSORS_LAST
    assert 16 * psi + beta + ACT_LAST == 2216328 and 12 * psi + beta + ACT_LAST == 1709640
    assert 11 * psi + beta + ACT_LAST == 1582968
    whole = 4 * 254016 + (4 + 12) * 254016 / 8 + 4 * S * V
    assert whole > 0.9 * 1.8e6
    model = build(WIDE, lazy=True)
    chosen, result = auto.choose(model, full(), 8, seq_len=S, cluster=profile(1.8e6))
    c = result.best.config
    assert (c.pp, c.dp, c.sharding) == (2, 4, 2), c.short()
    assert chosen.sharding.enable and chosen.sharding.stage == 2 and chosen.pipeline_parallel.degree == 2
    assert result.best.memory_per_device_gb * 1e9 == pytest.approx(1582968 + 0.1 * 1.8e6)
    assert "ZeRO-2 inside the 2 pipeline stages" in result.explanation
    # negative control: with room for the unsharded states the planner shards nothing inside the stages
    roomy, _ = auto.choose(model, full(), 8, seq_len=S, cluster=profile(1e8))
    assert not roomy.sharding.enable


def _batches(steps, batch=8):
    rng = np.random.default_rng(0)
    return [(paddle.to_tensor(rng.integers(0, V, (batch, S)), dtype="int64"),
             paddle.to_tensor(rng.integers(0, V, (batch, S)), dtype="int64")) for _ in range(steps)]


def test_auto_full_chooses_pp_zero1_and_trains_like_one_process(capsys):
    """2.2 MB per rank rules out the unsharded pipeline (2216328 B + the 220000 B reserve); of what fits, PP2 x DP4
    with ZeRO-1 (1709640 B + reserve) is the fastest: ZeRO-2 pays a 4-rank reduce_scatter (3 ms here, an all_reduce
    1 ms) and dp=8 without a pipeline (ZeRO-2 or ZeRO-3 fit) the 8-rank all_gathers (50 ms here). ap.parallelize
    runs it: 2 AdamW steps equal one process (losses and every rank's shard)."""
    from test_pipeline_sim import every_rank_mismatch

    data = _batches(2)
    paddle.seed(0)
    ref = build(WIDE)
    ref_opt = paddle.optimizer.AdamW(1e-2, parameters=ref.parameters())
    want = []
    for x, y in data:
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.clear_grad()
        want.append(float(loss))
    ref_params = {n: p.numpy() for n, p in ref.named_parameters()}
    cluster = profile(2.2e6, **{"reduce_scatter/4": 3e-3, "all_gather/8": 5e-2})
    with ap.simulate(world_size=8):
        paddle.seed(0)
        model = build(WIDE)
        opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
        pipe, opt = ap.parallelize(model, opt, strategy=full(), seq_len=S, cluster=cluster)
        chosen = ap.chosen_strategy(pipe)
        got = []
        for x, y in data:
            got.append(float(pipe.train_batch(x, y)))
            opt.step()
            opt.clear_grad()
        bad = every_rank_mismatch(pipe, ref_params)
    assert (chosen.pipeline_parallel.degree, chosen.data_parallel.degree) == (2, 4)
    assert chosen.sharding.enable and chosen.sharding.stage == 1
    assert "ZeRO-1 inside the 2 pipeline stages" in capsys.readouterr().out
    assert ap.chosen_plan(pipe).best.memory_per_device_gb * 1e9 == pytest.approx(1709640 + 220000)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert bad == []


def test_tied_embeddings_in_one_simulated_world_get_no_parallelism_inside_stages():
    """The simulated world lays out no parameter shared by stages on two stage meshes (a tied embedding / LM head):
    there the planner keeps dp = tp = 1 inside pipeline stages, so the plan it picks builds; on real ranks (which
    sum the tied gradients across stages) the same profile picks a pipeline over two data-parallel pairs."""
    from test_auto import profile as profile4

    dear = {f"{c}/4": 0.1 for c in ("all_gather", "reduce_scatter", "all_to_all", "broadcast")}
    dear["all_reduce/4"] = 5e-3
    cluster = profile4(**dear, **{"send_recv/2": 1e-5})
    tied = dataclasses.replace(PRESETS["gpt-tiny-tied"], vocab_size=256)
    assert not auto._inside_ok(build(tied), True) and auto._inside_ok(build(SMALL), True)
    real, _ = auto.choose(build(tied, lazy=True), full(), 4, seq_len=16, cluster=cluster)
    assert (real.pipeline_parallel.degree, real.data_parallel.degree) == (2, 2)
    with ap.simulate(world_size=4):
        model = build(tied)
        opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=full(), seq_len=16, cluster=cluster)
        chosen = ap.chosen_strategy(model)
    assert chosen.pipeline_parallel.degree == 1 or chosen.data_parallel.degree * chosen.tensor_parallel.degree == 1
