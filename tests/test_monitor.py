"""PerformanceMonitor: an artificially imbalanced pipeline run in-process (one layer sleeps longer) is
reported as imbalanced and the suggested split is the optimal partition of the measured layer times."""
import time

import numpy as np
import pytest

from autoparallel.monitor import PerformanceMonitor, even_split
from autoparallel.parallel.pipeline.split import balanced_split

LAYERS, STAGES = 8, 4


def _run_pipeline(mon, cost, sleep=time.sleep, steps=None):
    """Run every stage of a pipeline in this process; stage s holds the layers of the even split."""
    split = even_split(LAYERS, STAGES)
    for _ in range(steps or mon.warmup_steps + mon.measure_steps):
        with mon.record("step"):
            for s, (a, b) in enumerate(split):
                with mon.record("stage", index=s):
                    for i in range(a, b):
                        with mon.record("layer", index=i):
                            sleep(cost[i])
        mon.step()


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_imbalanced_pipeline_is_reported_and_resplit(tmp_path):
    cost = [0.002] * LAYERS
    cost[5] += 0.03                                   # the slow layer
    mon = PerformanceMonitor(warmup_steps=1, measure_steps=3, num_stages=STAGES,
                             layer_names=[f"blocks.{i}" for i in range(LAYERS)])
    _run_pipeline(mon, cost)
    assert mon.done
    measured = mon.layer_times()
    assert len(measured) == LAYERS and max(range(LAYERS), key=measured.__getitem__) == 5
    assert mon.is_imbalanced(threshold=0.2)
    imb = mon.imbalance()
    assert imb["slowest_stage"] == 2 and imb["stages"] > 0.2
    suggestion = mon.suggest_split()
    assert suggestion.split == [tuple(s) for s in balanced_split(measured, STAGES)]
    assert suggestion.split != even_split(LAYERS, STAGES)
    assert (5, 6) in suggestion.split                 # the slow layer gets a stage of its own
    assert suggestion.speedup > 1.0
    assert suggestion.split_points == [f"blocks.{a}" for a, _ in suggestion.split[1:]]
    text = mon.report(png=str(tmp_path / "mon.png"))
    assert "layer[5]" in text and "stage times (ms)" in text and "slowest stage 2" in text
    assert (tmp_path / "mon.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_balanced_pipeline_is_not_imbalanced_and_keeps_the_split():
    clock = FakeClock()
    mon = PerformanceMonitor(warmup_steps=2, measure_steps=4, num_stages=STAGES, clock=clock)
    _run_pipeline(mon, [0.01] * LAYERS, sleep=clock.sleep)
    assert mon.layer_times() == pytest.approx([0.01] * LAYERS)
    assert not mon.is_imbalanced(threshold=0.2)
    assert mon.suggest_split().split == even_split(LAYERS, STAGES)


def test_warmup_steps_are_not_measured_and_repeats_add_up():
    clock = FakeClock()
    mon = PerformanceMonitor(warmup_steps=2, measure_steps=2, clock=clock)
    for step in range(6):
        for _ in range(3):                            # e.g. once per micro-batch
            with mon.record("forward"):
                clock.sleep(1.0 if step < 2 else 0.5)
        mon.step()
    assert mon.timings() == {"forward": pytest.approx(1.5)}
    assert mon.gather() == {0: {"forward": pytest.approx(1.5)}}


def test_suggestion_replans_with_the_measured_profile():
    from autoparallel.planner.api import plan

    clock = FakeClock()
    mon = PerformanceMonitor(warmup_steps=0, measure_steps=2, num_stages=2, clock=clock)
    _run_pipeline(mon, [0.25] * LAYERS, sleep=clock.sleep)
    s = mon.suggest_split(2, model="gpt3-1.3b", cluster="1x8:A100-80GB", global_batch_size=64,
                                     current="dp=2,tp=2,pp=2")
    again = plan("gpt3-1.3b", s.cluster, 64, fixed="dp=2,tp=2,pp=2").best.step_time_s
    assert again == pytest.approx(2.0, rel=1e-6)      # the measured step time (8 layers x 0.25 s)
    assert s.plan.best is not None and s.strategy["data_parallel"]["degree"] * \
        s.strategy["tensor_parallel"]["degree"] * s.strategy["pipeline_parallel"]["degree"] == 8


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="measure_steps must be an int >= 1, got 0"):
        PerformanceMonitor(1, 0)
    mon = PerformanceMonitor(0, 1)
    with pytest.raises(ValueError, match="record index must be a non-negative int"):
        with mon.record("layer", index=-1):
            pass
    with pytest.raises(ValueError, match="no per-layer timings"):
        mon.suggest_split(2)
    with mon.record("layer", index=1):
        pass
    mon.step()
    with pytest.raises(ValueError, match=r"no timings for layer indices \[0\]"):
        mon.layer_times()


# ---- the article's loop: only record() blocks, steps inferred; a Strategy as the suggestion ----------------
def _article_loop(mon, clock, costs, steps=31, check=None):
    for step in range(steps):
        with mon.record("forward"):
            clock.sleep(costs[0])
        with mon.record("backward"):
            clock.sleep(costs[1])
        with mon.record("step"):
            clock.sleep(costs[2])
        if check is not None and step == 30:
            check(mon)


def test_steps_are_inferred_from_repeated_record_names():
    clock = FakeClock()
    mon = PerformanceMonitor(warmup_steps=10, measure_steps=20, clock=clock)
    seen = {}

    def check(m):
        seen.update(done=m.done, inferred=m.steps_inferred, timings=m.timings(), step=m.step_time(),
                    imbalanced=m.is_imbalanced())

    _article_loop(mon, clock, (1.0, 2.0, 0.5), check=check)
    assert seen["done"] and seen["inferred"] and seen["imbalanced"] is False
    assert seen["timings"] == pytest.approx({"forward": 1.0, "backward": 2.0, "step": 0.5})
    assert seen["step"] == pytest.approx(3.5)
    assert len(mon._totals) == 20                     # steps 10..29: the warm-up is not measured


def test_inferred_steps_skip_the_warmup_and_nested_records_do_not_start_steps():
    clock = FakeClock()
    mon = PerformanceMonitor(warmup_steps=1, measure_steps=2, clock=clock)
    for step in range(4):
        with mon.record("forward"):
            for i in range(2):
                for _ in range(2):                    # a nested name repeating (micro-batches) is not a new step
                    with mon.record("layer", index=i):
                        clock.sleep(1.0 if step == 0 else 0.25)
    assert mon.done and mon.timings() == pytest.approx({"forward": 1.0, "layer[0]": 0.5, "layer[1]": 0.5})


def test_step_after_inferred_steps_and_early_checks_are_refused():
    clock = FakeClock()
    mon = PerformanceMonitor(warmup_steps=1, measure_steps=1, clock=clock)
    with pytest.raises(ValueError, match="no measured step yet"):
        mon.is_imbalanced()
    _article_loop(mon, clock, (1, 1, 1), steps=3)
    with pytest.raises(ValueError, match="inferred 2 steps"):
        mon.step()


def test_suggestion_is_a_strategy_with_the_rebalanced_split():
    import autoparallel as ap

    clock = FakeClock()
    cost = [0.01] * LAYERS
    cost[5] += 0.05
    mon = PerformanceMonitor(warmup_steps=0, measure_steps=2, num_stages=STAGES, clock=clock,
                             layer_names=[f"blocks.{i}" for i in range(LAYERS)])
    _run_pipeline(mon, cost, sleep=clock.sleep)
    assert mon.is_imbalanced()
    s = mon.suggest_optimal_strategy()
    assert isinstance(s, ap.Strategy)
    best = [tuple(x) for x in balanced_split(mon.layer_times(), STAGES)]
    assert s.pipeline_parallel.degree == STAGES
    assert s.pipeline_parallel.split_points == [f"blocks.{a}" for a, _ in best[1:]]
    assert s.suggestion.split == best and s.suggestion.speedup > 1.0
    s.validate(world_size=STAGES)                     # a usable strategy


def test_split_names_come_from_the_run_models_block_list():
    import paddle

    import autoparallel as ap
    from autoparallel import auto_checkpoint

    class Net(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.layers = paddle.nn.LayerList([paddle.nn.Linear(2, 2) for _ in range(LAYERS)])

    strategy = ap.Strategy()
    strategy.pipeline_parallel.degree = 2
    strategy.pipeline_parallel.micro_batches = 2
    net = Net()                                 # the run holds its model weakly: keep it alive
    auto_checkpoint.attach(net, None, strategy)
    try:
        clock = FakeClock()
        cost = [0.01] * LAYERS
        cost[0] += 0.1
        mon = PerformanceMonitor(warmup_steps=0, measure_steps=1, clock=clock)
        _run_pipeline(mon, cost, sleep=clock.sleep, steps=1)
        with ap.simulate(world_size=2):                  # the run's world: the suggestion is validated on it
            s = mon.suggest_optimal_strategy()
        assert s.pipeline_parallel.split_points == ["layers.1"]        # the slow first layer alone
        assert s.pipeline_parallel.micro_batches == 2 and strategy.pipeline_parallel.split_points == []
    finally:
        auto_checkpoint.reset()


def test_a_straggler_in_synchronous_training_is_found_by_its_first_slow_phase():
    """Rank 1 computes its forward 50 ms longer; rank 0 waits for it in backward's all-reduce, so both step
    times are equal: the imbalance and the culprit show in the phases, in record order."""
    clock = FakeClock()
    mon = PerformanceMonitor(warmup_steps=0, measure_steps=2, clock=clock)
    _article_loop(mon, clock, (0.01, 0.02, 0.005), steps=3)
    mine = mon.timings()
    slow = dict(mine, forward=mine["forward"] + 0.05)
    waits = dict(mine, backward=mine["backward"] + 0.05)
    mon._gathered = {0: waits, 1: slow}
    mon._gathered_steps = {0: sum(waits.values()), 1: sum(slow.values())}
    mon._gathered_comm = {0: {"backward": 0.05}, 1: {}}                      # rank 0 waited in all-reduce
    mon._gathered_compute = {0: sum(mine.values()), 1: sum(slow.values())}
    imb = mon.imbalance()
    assert imb["rank_steps"][0] == pytest.approx(imb["rank_steps"][1])       # the step times hide it
    assert imb["ranks"] == pytest.approx(0.025 / (sum(mine.values()) + 0.025), rel=1e-6)   # compute skew
    assert mon.is_imbalanced() and imb["slowest_rank"] == 1 and imb["slowest_phase"] == "forward"
    mon._gathered = {0: mine, 1: dict(mine, forward=mine["forward"] * 1.01)}  # noise: 1 % of one phase
    mon._gathered_steps = {0: 0.035, 1: 0.0351}
    mon._gathered_comm, mon._gathered_compute = {0: {}, 1: {}}, {0: 0.035, 1: 0.0351}
    assert not mon.is_imbalanced()


def test_time_blocked_in_collectives_is_measured_per_phase(monkeypatch):
    import paddle.distributed as dist

    from autoparallel import monitor as monitor_module

    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: time.sleep(0.03))
    monkeypatch.setattr(monitor_module, "_comm_timer", monitor_module._CommTimer())
    mon = PerformanceMonitor(warmup_steps=0, measure_steps=2)
    for _ in range(3):
        with mon.record("forward"):
            pass
        with mon.record("backward"):
            dist.all_reduce(None)                     # e.g. a gradient bucket waiting for a slower peer
    comm = mon.comm_timings()
    assert set(comm) == {"backward"} and comm["backward"] >= 0.03
    assert mon.timings()["backward"] >= comm["backward"]
    timed = dist.all_reduce
    mon.stop()                                        # the monitor's own stop puts paddle's function back
    assert dist.all_reduce is not timed and dist.all_reduce.__name__ == "<lambda>"


def test_a_simulated_pipeline_reports_its_stage_times_and_gets_a_resplit():
    """No per-layer records: the monitor reads the pipeline's own action timings (stage compute, transfers
    excluded); a slow first block makes stage 0 the bottleneck and the suggestion moves layers off it."""
    import paddle

    import autoparallel as ap
    from autoparallel import auto_checkpoint
    from autoparallel.testing.models import batch
    from examples.models import GPT, GPTConfig

    auto_checkpoint.reset()
    try:
        with ap.simulate(world_size=2):
            paddle.seed(0)
            model = GPT(GPTConfig(vocab_size=64, hidden=32, layers=4, heads=4, max_positions=16))
            model.blocks[0].register_forward_post_hook(lambda *_: time.sleep(0.1))
            s = ap.Strategy()
            s.pipeline_parallel.degree = 2
            pipe, opt = ap.parallelize(model, paddle.optimizer.AdamW(1e-3, parameters=model.parameters()), strategy=s)
            mon = PerformanceMonitor(warmup_steps=1, measure_steps=2)
            for i in range(4):
                with mon.record("step"):
                    ids, lab = batch(i)
                    pipe.train_batch(paddle.to_tensor(ids), paddle.to_tensor(lab))
                    opt.step()
                    opt.clear_grad()
            imb = mon.imbalance()
            assert mon.is_imbalanced() and imb["slowest_stage"] == 0 and len(imb["stage_times"]) == 2
            new = mon.suggest_optimal_strategy()
            assert new.pipeline_parallel.degree == 2 and new.pipeline_parallel.split_points == ["blocks.1"]
            assert new.suggestion.current_split == [(0, 2), (2, 4)] and new.suggestion.speedup > 1.05
            new.validate(world_size=2)
    finally:
        auto_checkpoint.reset()


def test_the_pipeline_suggestion_reconfigures_the_pipeline_in_place():
    import paddle
    import paddle.nn.functional as F

    import autoparallel as ap
    from autoparallel import auto_checkpoint
    from autoparallel.testing.models import batch
    from examples.models import GPT, GPTConfig

    def gpt():
        paddle.seed(0)
        return GPT(GPTConfig(vocab_size=64, hidden=32, layers=4, heads=4, max_positions=16))

    ref = gpt()
    ref_opt = paddle.optimizer.AdamW(1e-3, parameters=ref.parameters())
    for i in range(3):
        ids, lab = batch(i)
        F.cross_entropy(ref(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean().backward()
        ref_opt.step()
        ref_opt.clear_grad()
    auto_checkpoint.reset()
    try:
        with ap.simulate(world_size=2):
            model = gpt()
            s = ap.Strategy()
            s.pipeline_parallel.degree = 2
            pipe, opt = ap.parallelize(model, paddle.optimizer.AdamW(1e-3, parameters=model.parameters()), strategy=s)
            new = ap.Strategy()
            new.pipeline_parallel.degree = 2
            new.pipeline_parallel.split_points = ["blocks.1"]
            for i in range(3):
                if i == 1:
                    ap.reconfigure_distributed_model(pipe, new)        # in place, as the article calls it
                    assert pipe.plan.bounds[0] == (0, 1)
                ids, lab = batch(i)
                pipe.train_batch(paddle.to_tensor(ids), paddle.to_tensor(lab))
                opt.step()
                opt.clear_grad()
            import tempfile

            from autoparallel.checkpoint.state import training_state

            path = tempfile.mkdtemp(prefix="ap_pipe_") + "/s"
            ap.save_state_dict(training_state(pipe), path)
        got = ap.load_merged_state_dict(path)["model"]
        for name, p in ref.named_parameters():
            np.testing.assert_allclose(got[name], p.numpy(), rtol=1e-4, atol=2e-5, err_msg=name)
    finally:
        auto_checkpoint.reset()
