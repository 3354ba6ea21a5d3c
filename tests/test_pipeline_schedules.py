"""Pipeline schedules as data, executed by the discrete-event simulator (pure: no process groups).

Formula exactness: with every stage taking the same F and the same B (any F:B ratio) and zero
latency, the simulated bubble fraction (idle compute slots / (ranks * makespan)) equals
(p-1)/(m+p-1) for FThenB and 1F1B and (p-1)/(v*m+p-1) for VPP with per-chunk times.
"""
import json

import pytest

from autoparallel.parallel.pipeline import (Action, PipelineDeadlock, bubble_formula, check_communication,
                                            make_schedule, simulate)
from autoparallel.parallel.pipeline.schedules import Schedule

PM = [(1, 3), (2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8), (4, 13), (8, 8), (8, 24)]


@pytest.mark.parametrize("name", ["FThenB", "1F1B"])
@pytest.mark.parametrize("p,m", PM)
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.0, 1.0), (0.3, 0.7)])
def test_bubble_formula_is_exact(name, p, m, f, b):
    result = simulate(make_schedule(name, p, m), forward=f, backward=b)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert result.total_time == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (2, 6, 3), (3, 6, 2), (4, 4, 2), (4, 8, 2),
                                   (4, 8, 4), (8, 16, 2), (1, 3, 2)])
def test_vpp_bubble_formula_is_exact(p, m, v):
    result = simulate(make_schedule("VPP", p, m, v), forward=1.0 / v, backward=2.0 / v)
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    one_f_one_b = simulate(make_schedule("1F1B", p, m), forward=1.0, backward=2.0)
    assert result.total_time <= one_f_one_b.total_time + 1e-9


@pytest.mark.parametrize("p,m", [(2, 2), (2, 6), (3, 5), (4, 4), (4, 8), (8, 16)])
def test_zb_h1_is_below_1f1b(p, m):
    zb = simulate(make_schedule("ZB-H1", p, m), forward=1.0, backward=2.0)   # B = W = 1
    base = simulate(make_schedule("1F1B", p, m), forward=1.0, backward=2.0)
    assert zb.bubble_fraction < base.bubble_fraction
    assert zb.bubble_fraction == pytest.approx(bubble_formula("ZB-H1", p, m))          # (p-1)/(3m+p-1)
    assert max(zb.peak_live.values()) <= p             # F..W live micro-batches: the same cap as 1F1B
    uneven = dict(forward=[1.0, 1.5] * (p // 2) + [1.0] * (p % 2), backward=2.5, latency=0.1)
    assert simulate(make_schedule("ZB-H1", p, m), **uneven).total_time < \
        simulate(make_schedule("1F1B", p, m), **uneven).total_time


def test_hand_computed_small_case():
    # 1F1B, p=2, m=2, F = [1, 2], B = [2, 3], latency 0.5, non-blocking sends:
    # r0: F0 [0,1] F1 [1,2]; r1: F0 [1.5,3.5] B0 [3.5,6.5] F1 [6.5,8.5] B1 [8.5,11.5]
    # r0: B0 waits for the gradient sent at 6.5 -> [7,9]; B1 sent at 11.5 -> [12,14]
    s = make_schedule("1F1B", 2, 2)
    r = simulate(s, forward=[1, 2], backward=[2, 3], latency=0.5)
    assert r.total_time == pytest.approx(14.0)
    assert r.busy == [6.0, 10.0]
    assert r.bubble_fraction == pytest.approx(1 - 16 / 28)
    assert (r.start(Action("B", 0, 0)), r.end(Action("B", 0, 1))) == (7.0, 14.0)
    # blocking sends: each transfer also waits for its receive to be posted -> 15
    assert simulate(s, forward=[1, 2], backward=[2, 3], latency=0.5, rendezvous=True).total_time == \
        pytest.approx(15.0)


@pytest.mark.parametrize("name,v", [("FThenB", 1), ("1F1B", 1), ("VPP", 2), ("ZB-H1", 1)])
def test_unequal_stages_reported_within_bounds(name, v):
    p, m = 3, 6
    f = [1.0, 2.0, 1.0] * v
    b = [2.0, 3.5, 1.5] * v
    r = simulate(make_schedule(name, p, m, v), forward=f, backward=b, latency=0.2)
    work = [m * sum(f[s] + b[s] for s in range(rank, p * v, p)) for rank in range(p)]
    slowest = max(range(p), key=lambda k: work[k])
    # the slowest rank must do all its work, after the first forward reaches it and (without W, whose
    # work may overlap the drain) before the last backward leaves it; the makespan never exceeds
    # running every action back to back
    lower = work[slowest] + sum(f[:slowest]) + (sum(b[:slowest]) if name != "ZB-H1" else 0.0)
    assert lower - 1e-9 <= r.total_time <= sum(work) + 2 * p * v * m * 0.2
    assert 0.0 < r.bubble_fraction < 1.0
    assert r.bubble_fraction > bubble_formula(name, p, m, v) - 1e-9 or name == "ZB-H1"


@pytest.mark.parametrize("name", ["FThenB", "1F1B", "VPP", "ZB-H1"])
def test_no_deadlock_and_consistent_transfers(name):
    for p in range(1, 7):
        for m in range(p, 3 * p + 2):
            for v in ((2, 3) if name == "VPP" else (1,)):
                if name == "VPP" and m % p:
                    continue
                s = make_schedule(name, p, m, v)
                check_communication(s)
                _check_structure(s)
                for rendezvous in (False, True):
                    simulate(s, forward=[1.0 + 0.1 * k for k in range(p * v)], backward=2.0, latency=0.3,
                             rendezvous=rendezvous)


def _check_structure(s: Schedule):
    stages = s.num_ranks * s.vpp
    for rank, acts in enumerate(s):
        assert all(s.rank_of(a.stage) == rank for a in acts)
        for a in acts:
            if a.is_comm:
                assert a.peer_rank == s.rank_of(a.peer) != rank
    kinds = ("F", "B", "W") if s.name == "ZB-H1" else ("F", "B")
    got = sorted((a.kind, a.stage, a.microbatch) for acts in s for a in acts if a.is_compute)
    assert got == sorted((k, st, i) for k in kinds for st in range(stages) for i in range(s.micro_batches))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 12), (6, 9)])
def test_peak_inflight(p, m):
    one = simulate(make_schedule("1F1B", p, m))
    assert all(n <= p for n in one.peak_inflight.values())
    assert one.peak_inflight_rank == [min(p - r, m) for r in range(p)]
    gpipe = simulate(make_schedule("FThenB", p, m))
    assert set(gpipe.peak_inflight.values()) == {m}


def test_vpp_places_virtual_stage_on_rank_mod_p():
    s = make_schedule("VPP", 3, 6, 2)
    assert s.num_stages == 6
    assert {a.stage for a in s.compute(1)} == {1, 4}


def test_deadlock_is_detected_with_stuck_ranks():
    # rank 0 waits for a gradient before sending the activation that would produce it
    f0, b0 = Action("F", 0, 0), Action("B", 0, 0)
    send, recv_b = Action("SEND_F", 0, 0, 1, 1), Action("RECV_B", 0, 0, 1, 1)
    rank1 = [Action("RECV_F", 1, 0, 0, 0), Action("F", 1, 0), Action("B", 1, 0), Action("SEND_B", 1, 0, 0, 0)]
    with pytest.raises(PipelineDeadlock, match=r"rank 0 .*RECV_B0.*rank 1 .*RECV_F0"):
        simulate([[f0, recv_b, send, b0], rank1])


def test_naive_transfer_placement_deadlocks_only_with_blocking_sends():
    # sends right after their producer, receives right before their consumer: fine with non-blocking
    # sends, but two neighbours that both send first wait on each other when sends block
    naive = []
    for rank, acts in enumerate(make_schedule("1F1B", 2, 3)):
        out = []
        for a in (a for a in acts if a.is_compute):
            if a.kind == "F" and rank == 1:
                out.append(Action("RECV_F", 1, a.microbatch, 0, 0))
            if a.kind == "B" and rank == 0:
                out.append(Action("RECV_B", 0, a.microbatch, 1, 1))
            out.append(a)
            if a.kind == "F" and rank == 0:
                out.append(Action("SEND_F", 0, a.microbatch, 1, 1))
            if a.kind == "B" and rank == 1:
                out.append(Action("SEND_B", 1, a.microbatch, 0, 0))
        naive.append(out)
    check_communication(naive)
    simulate(naive)
    with pytest.raises(PipelineDeadlock):
        simulate(naive, rendezvous=True)


def test_check_communication_errors():
    s = [list(acts) for acts in make_schedule("1F1B", 2, 3)]
    missing = [[a for a in s[0] if a != Action("SEND_F", 0, 1, 1, 1)], s[1]]
    with pytest.raises(ValueError, match="no matching SEND_F"):
        check_communication(missing)
    swapped = [list(s[0]), s[1]]
    i, j = swapped[0].index(Action("SEND_F", 0, 0, 1, 1)), swapped[0].index(Action("SEND_F", 0, 1, 1, 1))
    swapped[0][i], swapped[0][j] = swapped[0][j], swapped[0][i]
    with pytest.raises(ValueError, match="same order"):
        check_communication(swapped)


def test_bad_inputs():
    with pytest.raises(ValueError, match="valid: FThenB, 1F1B, VPP, ZB-H1"):
        make_schedule("Chimera", 2, 4)
    with pytest.raises(ValueError, match="micro_batches >= pipeline stages.*FThenB"):
        make_schedule("1F1B", 4, 2)
    with pytest.raises(ValueError, match="micro_batches >= pipeline stages"):
        make_schedule("ZB-H1", 4, 3)
    with pytest.raises(ValueError, match="multiple of pp"):
        make_schedule("VPP", 4, 6, 2)
    with pytest.raises(ValueError, match="vpp >= 2"):
        make_schedule("VPP", 2, 4, 1)
    with pytest.raises(ValueError, match="only applies to the VPP"):
        make_schedule("1F1B", 2, 4, 2)
    with pytest.raises(ValueError, match="pp must be >= 1"):
        make_schedule("FThenB", 0, 4)
    with pytest.raises(TypeError, match="micro_batches must be an int"):
        make_schedule("FThenB", 2, 4.0)
    with pytest.raises(ValueError, match="one duration per stage"):
        simulate(make_schedule("1F1B", 2, 4), forward=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="latency"):
        simulate(make_schedule("1F1B", 2, 4), latency=-1)
    with pytest.raises(ValueError, match="kind must be one of"):
        Action("X", 0, 0)
    with pytest.raises(ValueError, match="exactly one B"):
        simulate([[Action("F", 0, 0)]])
    assert make_schedule("zb-h1", 2, 2).name == "ZB-H1"       # names are case-insensitive


def test_timeline_png_and_cli(tmp_path):
    from autoparallel.parallel.pipeline import bubble_fraction, plot_schedule, plot_timeline

    fig, result = plot_schedule(make_schedule("VPP", 2, 4, 2), str(tmp_path / "vpp.png"))
    assert (tmp_path / "vpp.png").stat().st_size > 1000
    assert bubble_fraction(result.records()) == pytest.approx(result.bubble_fraction)
    measured = [(0, "F", 0, 0, 10.0, 11.0), (1, "F", 1, 0, 11.2, 12.0), (1, "B", 1, 0, 12.0, 13.0),
                (0, "B", 0, 0, 13.1, 14.5)]
    plot_timeline(measured, str(tmp_path / "measured.png"), title="measured")
    assert bubble_fraction(measured) == pytest.approx(1 - 4.2 / (2 * 4.5))

    from tools import plot_schedule as cli
    assert cli.main(["--schedule", "1F1B", "--pp", "4", "--micro-batches", "8",
                     "--out", str(tmp_path / "out" / "1f1b.png")]) == 0
    assert (tmp_path / "out" / "1f1b.png").exists()
    (tmp_path / "run.json").write_text(json.dumps([list(r) for r in measured]))
    assert cli.main(["--records", str(tmp_path / "run.json"), "--out", str(tmp_path / "m.png")]) == 0
    assert cli.main(["--schedule", "1F1B", "--pp", "4", "--micro-batches", "2", "--out",
                     str(tmp_path / "x.png")]) == 2
