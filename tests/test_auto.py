"""auto_mode="full" in ap.parallelize, in process: what the planner chooses, the restrictions of the eager
runtime, bad input, and one training step of the chosen strategy in the simulated world against the plain
model (multi-step training on real ranks: tests/test_auto_dist.py)."""
import dataclasses

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.planner import auto
from autoparallel.planner.api import plan
from autoparallel.planner.calibrate import cpu_profile
from autoparallel.planner.cluster import CollectiveFit, RuntimeSpec
from autoparallel.planner.model_spec import ModelSpec
from autoparallel.planner.profiles import cpu_default


from models import PRESETS, build  # noqa: E402

CONFIG = dataclasses.replace(PRESETS["gpt-tiny"], vocab_size=256)


def strategy(batch=8):
    s = ap.Strategy()
    s.auto_mode = "full"
    s.global_batch_size = batch
    return s


def profile(**latency):
    """A CPU profile whose collectives cost the given latencies (others 1 ms), no per-op costs."""
    fits = []
    for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        for n in (2, 4):
            fits.append(CollectiveFit(name, n, latency.get(f"{name}/{n}", 1e-3), 1e12))
    fits.append(CollectiveFit("send_recv", 2, latency.get("send_recv/2", 1e-3), 1e12))
    rt = RuntimeSpec(op_s=1e-6, dispatch_s=5e-5, backward_s=2e-5, optimizer_tensor_s=2e-5)
    return cpu_profile(2e10, 8e10, 3.2e10, 4, collectives=tuple(fits), runtime=rt)


def test_choice_is_the_fastest_valid_configuration():
    model = build(CONFIG, lazy=True)
    chosen, result = auto.choose(model, strategy(), 4, seq_len=16, cluster=cpu_default())
    best = result.best
    assert chosen.auto_mode == "semi"
    assert (chosen.data_parallel.degree, chosen.tensor_parallel.degree) == (best.config.dp, best.config.tp)
    degrees = chosen.validate(world_size=4, model_info={"heads": 4, "hidden": 32, "layers": 2})
    assert degrees.dp * degrees.tp * degrees.pp == 4
    assert degrees.global_batch_size == 8
    # nothing the eager runtime can run is faster: the same search, ranked by ap.plan
    spec = ModelSpec.from_trace(model, 16, 1)
    flat = plan(spec, cpu_default(), 8, 16, top=200, pp=[1], offload=[0])
    assert min(c.step_time_s for c in flat.candidates) == pytest.approx(best.step_time_s, rel=1e-12) or \
        best.config.pp > 1
    assert "Why #1" in result.explanation and "pipeline stages" in result.explanation


def test_expensive_four_rank_collectives_push_the_choice_to_pairs():
    """With four-rank collectives 100x dearer than two-rank ones, no configuration with a 4-rank group wins."""
    model = build(CONFIG, lazy=True)
    dear = {f"{c}/4": 0.1 for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")}
    chosen, result = auto.choose(model, strategy(), 4, seq_len=16, cluster=profile(**dear))
    c = result.best.config
    assert c.dp != 4 and c.tp != 4, c.short()
    cheap, _ = auto.choose(model, strategy(), 4, seq_len=16, cluster=profile())
    assert cheap.to_dict() != chosen.to_dict()


def test_pipelines_only_without_zero_and_recompute():
    """Cheap point-to-point messages, two-rank all_reduces of 1 ms and four-rank ones of 5 ms make a
    pipeline over two data-parallel pairs the fastest (fewer collectives than DP2xTP2, fewer four-rank ones
    than DP4); it comes without ZeRO, recompute or offload (the pipeline runtime composes with dp and tp
    only) and with at least pp micro-batches (1F1B)."""
    model = build(CONFIG, lazy=True)
    dear = {f"{c}/4": 0.1 for c in ("all_gather", "reduce_scatter", "all_to_all", "broadcast")}
    dear["all_reduce/4"] = 5e-3
    chosen, result = auto.choose(model, strategy(), 4, seq_len=16, cluster=profile(**dear, **{"send_recv/2": 1e-5}))
    pp = chosen.pipeline_parallel
    assert pp.degree == 2
    assert not chosen.sharding.enable and not chosen.recompute.enable
    assert chosen.num_micro_batches >= pp.degree


def test_bad_input_is_a_typed_error(tmp_path, monkeypatch):
    model = build(CONFIG, lazy=True)
    no_batch = ap.Strategy()
    no_batch.auto_mode = "full"
    with pytest.raises(ValueError, match="global_batch_size"):
        auto.choose(model, no_batch, 4, seq_len=16, cluster=cpu_default())
    with pytest.raises(ValueError, match="seq_len"):
        auto.choose(model, strategy(), 4, seq_len=0, cluster=cpu_default())
    monkeypatch.setenv(auto.ENV_PROFILE, str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="AP_CLUSTER_PROFILE"):
        auto.choose(model, strategy(), 4, seq_len=16)
    with pytest.raises(ValueError, match="no configuration"):
        auto.choose(model, strategy(), 3, seq_len=16, cluster=cpu_default())   # dp=3 splits no batch of 8


def test_profile_from_the_environment(tmp_path, monkeypatch):
    model = build(CONFIG, lazy=True)
    dear = {f"{c}/4": 0.1 for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")}
    path = tmp_path / "profile.json"
    profile(**dear).to_json(str(path))
    monkeypatch.setenv(auto.ENV_PROFILE, str(path))
    from_env, result = auto.choose(model, strategy(), 4, seq_len=16)
    direct, _ = auto.choose(model, strategy(), 4, seq_len=16, cluster=str(path))
    assert from_env.to_dict() == direct.to_dict() and result.cluster.collectives == profile(**dear).collectives


def test_parallelize_full_trains_one_step_like_the_plain_model(capsys):
    """ap.parallelize with auto_mode='full' (simulated world of 4): prints the explanation, returns the chosen
    strategy, and the first step's loss and updated parameters equal the plain model's."""
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, 256, (8, 16)), dtype="int64")
    labels = paddle.to_tensor(np.random.default_rng(1).integers(0, 256, (8, 16)), dtype="int64")
    paddle.seed(0)
    ref = build(CONFIG)
    ref_opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=ref.parameters())     # linear: exact to rounding
    ref_loss = F.cross_entropy(ref(ids), labels)
    ref_loss.backward()
    ref_opt.step()
    with ap.simulate(4):
        paddle.seed(0)
        model = build(CONFIG)
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=strategy(), seq_len=16, cluster=cpu_default())
        chosen = ap.chosen_strategy(model)
        k = chosen.gradient_accumulation_steps
        assert chosen.pipeline_parallel.degree == 1
        total = 0.0
        for x, y in zip(paddle.split(ids, k), paddle.split(labels, k)):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            total += float(loss) / k
        opt.step()
        params = {n: p.full().numpy() for n, p in model.named_parameters()}
    out = capsys.readouterr().out
    assert "auto_mode='full': planned for 4 ranks" in out and "#1 " in out and "chosen:" in out
    assert ap.chosen_plan(model).best.config.dp == chosen.data_parallel.degree
    assert total == pytest.approx(float(ref_loss), rel=1e-5)
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(params[n], p.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)


def test_the_planner_returns_a_strategy_and_leaves_applying_it_to_parallelize(capsys):
    model = build(CONFIG, lazy=True)
    with ap.simulate(4):
        chosen, result = auto.plan_strategy(model, strategy(), seq_len=16, cluster=cpu_default())
    assert isinstance(chosen, ap.Strategy) and chosen.auto_mode == "semi"
    assert (result.best.config.dp, result.best.config.tp) == (chosen.data_parallel.degree,
                                                              chosen.tensor_parallel.degree)
    assert ap.mesh_of(model) is None and not any(ap.is_dist(p) for p in model.parameters())
    assert "chosen:" in capsys.readouterr().out
