"""ap.profile in one process: the parts add up to the measured region, collectives and bytes equal hand
counts, waits follow the cross-rank rule, the plot is written; misuse raises and the hooks come off."""
import os
import time

import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel import dispatch, redistribute
from autoparallel.comm import transport
from autoparallel.planner.profiles import cpu_default
from autoparallel.profiler import breakdown
from autoparallel.profiler.timeline import Timeline
from autoparallel.testing.models import batch, build


def _tp_pair(mesh):
    """x (replicated) @ W1 (column shard) @ W2 (row shard): one partial output, one all_reduce to replicate it."""
    paddle.seed(0)
    x = ap.shard_tensor(paddle.randn([4, 8]), mesh, [ap.Replicate()])
    w1 = ap.shard_tensor(paddle.randn([8, 16]), mesh, [ap.Shard(1)])
    w2 = ap.shard_tensor(paddle.randn([16, 8]), mesh, [ap.Shard(0)])
    return x, w1, w2


def test_collectives_and_bytes_equal_hand_counts():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["model"])
        x, w1, w2 = _tp_pair(mesh)
        with ap.profile() as p:
            y = ap.reshard(paddle.matmul(paddle.matmul(x, w1), w2), mesh, [ap.Replicate()])
        b = p.breakdowns[-1]
        assert b.collectives["all_reduce"]["count"] == 1
        assert b.collectives["all_reduce"]["bytes"] == 2 * (2 - 1) / 2 * 4 * 8 * 4     # ring: 2(n-1)/n · b
        assert set(b.collectives) == {"all_reduce"}
        assert b.counts["dispatched ops"] == 2 and b.counts["reshards"] == 1
        full = paddle.matmul(paddle.matmul(x.full(), w1.full()), w2.full())
        assert float((y.full() - full).abs().max()) < 1e-4
        # negative control: replicated operands need no communication
        with ap.profile() as q:
            paddle.matmul(x, ap.shard_tensor(paddle.randn([8, 3]), mesh, [ap.Replicate()]))
        assert q.breakdowns[-1].collectives == {} and q.breakdowns[-1].counts["dispatched ops"] == 1


def _gpt_step():
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = 2, 2
    model = build("gpt")
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    model, opt = ap.parallelize(model, opt, s)
    ids, labels = batch()

    def step():
        loss = F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(labels)).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
    return step


def test_parts_add_up_and_counts_match_the_transport(tmp_path):
    with ap.simulate(world_size=4):
        step = _gpt_step()
        step()
        seen = []                                         # an independent count of the transport's collectives
        originals = {n: getattr(transport.SimTransport, n) for n in ("all_gather", "all_reduce", "reduce_scatter",
                                                                      "all_to_all", "broadcast", "send_recv")}
        for n, fn in originals.items():
            setattr(transport.SimTransport, n, lambda self, *a, __n=n, __f=fn: (seen.append(__n), __f(self, *a))[1])
        try:
            with ap.profile() as p:
                start = time.perf_counter()
                step()
                wall = time.perf_counter() - start
        finally:
            for n, fn in originals.items():
                setattr(transport.SimTransport, n, fn)
    b = p.breakdowns[-1]
    assert sum(b.parts.values()) == pytest.approx(b.step_s, abs=1e-4)
    assert wall <= b.step_s < 1.5 * wall + 0.05          # the step's own wall time (slack: a loaded machine)
    assert b.parts["compute: dispatched ops"] > 0 and b.parts["dispatch overhead"] > 0
    assert b.parts["idle wait"] == 0 and b.parts["pipeline bubble"] == 0      # one process waits for nobody
    assert {k: v["count"] for k, v in b.collectives.items()} == {n: seen.count(n) for n in set(seen)}
    assert seen                                                                # DP x TP communicates
    path = p.plot(str(tmp_path / "bars.png"))
    assert os.path.getsize(path) > 1000
    assert "sim" in p.table() and "all_reduce" in p.table()


def test_pipeline_actions_are_profiled():
    import pp_common
    from autoparallel.parallel.pipeline.runtime import apply_pp

    pipe = apply_pp(pp_common.build("gpt", layers=2), pp_common.strategy({"schedule": "1F1B"}))
    ids, labels = pp_common.batches(1)[0]
    with ap.profile() as p:
        pipe.train_batch(paddle.to_tensor(ids), paddle.to_tensor(labels))
    b = p.breakdowns[0]
    assert b.counts["pipeline p2p actions"] == sum(r.kind.startswith(("SEND", "RECV")) for r in pipe.records) > 0
    assert sum(b.parts.values()) == pytest.approx(b.step_s, abs=1e-4)
    assert b.parts["comm overhead"] > 0 and b.parts["pipeline bubble"] == 0     # hand-offs in one process


def test_hooks_come_off_and_misuse_raises():
    before = (dispatch.run, dispatch._execute, redistribute.execute, transport.RealTransport.all_reduce)
    sim_before = dict(transport.SimTransport.__dict__)
    with pytest.raises(ZeroDivisionError):
        with ap.profile():
            1 / 0
    assert (dispatch.run, dispatch._execute, redistribute.execute, transport.RealTransport.all_reduce) == before
    assert dict(transport.SimTransport.__dict__) == sim_before
    with ap.profile():
        with pytest.raises(RuntimeError, match="do not nest"):
            ap.profile().start()
    with pytest.raises(RuntimeError, match="no completed region"):
        ap.profile().table()
    with pytest.raises(TypeError, match="bool"):
        ap.profile(gather="yes")
    with pytest.raises(RuntimeError, match="without start"):
        ap.profile().stop()


def test_timeline_charges_each_instant_to_the_innermost_category():
    ticks = iter([0.0, 1.0, 3.0, 4.0, 7.0, 8.0, 10.0])
    tl = Timeline(clock=lambda: next(ticks))
    tl.enter("dispatch")                   # 1: outside 0-1
    tl.enter("compute.ops")                # 3: dispatch 1-3
    tl.leave()                             # 4: ops 3-4
    tl.enter_collective("all_reduce")      # 7: dispatch 4-7
    tl.leave_collective("all_reduce", 8.0, 2, 8.0, (0, 1))    # 8: collective 7-8
    tl.leave()                             # 10: dispatch 8-10
    assert tl.seconds == {"outside": 1.0, "dispatch": 7.0, "compute.ops": 1.0, "collective": 1.0}
    (call,) = tl.calls
    assert call.seconds == 1.0 and call.context == "dispatch" and call.ranks == (0, 1)


def _rec(rank, calls, step_s=1.0):
    total = sum(c[5] for c in calls)
    return {"rank": rank, "step_s": step_s, "seconds": {"outside": step_s - total, "collective": total},
            "counts": {}, "calls": calls, "simulated": False}


def test_wait_is_the_excess_over_the_fastest_member():
    recs = {0: _rec(0, [["all_reduce", 8.0, 2, 8.0, [0, 1], 0.30, "outside"],
                        ["recv", 0.0, 2, 64.0, [0, 1], 0.05, "pipeline.p2p"]]),
            1: _rec(1, [["all_reduce", 8.0, 2, 8.0, [0, 1], 0.10, "outside"],
                        ["send", 64.0, 2, 64.0, [0, 1], 0.02, "pipeline.p2p"]])}
    out = breakdown.build_all(recs, cpu_default())
    assert out[0].parts["idle wait"] == pytest.approx(0.20)
    assert out[0].parts["pipeline bubble"] == pytest.approx(0.03)
    assert out[1].parts["idle wait"] == 0 and out[1].parts["pipeline bubble"] == 0
    assert out[0].parts["collectives"] == pytest.approx(0.12)
    for b in out.values():
        assert sum(b.parts.values()) == pytest.approx(b.step_s)
    # one rank alone: the calibrated fit prices the transfer, the rest is wait
    alone = breakdown.build_all({0: recs[0]}, cpu_default())[0]
    fit = cpu_default().collective_fit("all_reduce", 2).seconds(8.0)
    assert alone.collectives["all_reduce"]["wait"] == pytest.approx(0.30 - fit)


def test_average_and_median_of_regions():
    from autoparallel.profiler.breakdown import RankBreakdown, average

    def one(step, ops):
        parts = dict.fromkeys(breakdown.PARTS, 0.0)
        parts["compute: dispatched ops"], parts["compute: other"] = ops, step - ops
        return {0: RankBreakdown(0, step, parts, {"all_reduce": {"count": 2, "bytes": 8.0, "seconds": 0.1,
                                                                  "wait": 0.0}}, {"dispatched ops": 4})}
    runs = [one(1.0, 0.4), one(3.0, 0.5), one(10.0, 0.6)]
    mean = average(runs)[0]
    assert mean.step_s == pytest.approx(14 / 3) and mean.parts["compute: dispatched ops"] == pytest.approx(0.5)
    assert sum(mean.parts.values()) == pytest.approx(mean.step_s)
    assert mean.collectives["all_reduce"]["count"] == 2
    assert average(runs, "median")[0] is runs[1][0]
    with pytest.raises(ValueError, match="mean' or 'median"):
        average(runs, "max")
    with pytest.raises(ValueError, match="same ranks"):
        average([runs[0], {1: runs[1][0]}])


def test_example_profile_flag(tmp_path, capsys):
    import json

    import train_common

    path = str(tmp_path / "out" / "step.png")
    train_common.main("gpt-tiny", ["--steps", "2", "--batch-size", "2", "--seq-len", "8", "--profile", path])
    assert os.path.getsize(path) > 1000
    with open(os.path.splitext(path)[0] + ".json") as f:
        (b,) = json.load(f).values()
    assert sum(b["parts"].values()) == pytest.approx(b["step_s"], abs=1e-4)
    assert b["parts"]["compute: backward"] > 0 and b["parts"]["compute: optimizer"] > 0
    assert "step-time breakdown" in capsys.readouterr().out


def test_a_missing_hook_point_is_named_and_nothing_stays_patched(monkeypatch):
    before = (dispatch.run, redistribute.execute)
    monkeypatch.delattr(dispatch, "_execute")
    with pytest.raises(RuntimeError, match="_execute: it no longer exists"):
        ap.profile().start()
    assert (dispatch.run, redistribute.execute) == before
    monkeypatch.undo()
    with ap.profile():                      # and a profile opens again afterwards
        pass
