"""Code that runs on some ranks only, in process: one-element Partial results are reduced where every rank makes
them (so ``if rank == 0: print(loss.item())`` reads locally), and the collective agreement check turns a
collective made on some ranks only into ``CollectiveMismatchError`` on every rank, before any payload moves
(two ranks as two threads over a fake ``paddle.distributed``)."""
import threading

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.comm import agreement
from autoparallel.comm.counter import count_collectives
from autoparallel.comm.transport import RealTransport


class MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((8, 8)).astype("float32"), rng.integers(0, 4, (8,))


def reference():
    x, y = data()
    paddle.seed(0)
    m = MLP()
    loss = F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
    loss.backward()
    return float(loss), m.fc1.weight.grad.numpy()


def dp_step(world_size=2):
    x, y = data()
    paddle.seed(0)
    m = MLP()
    opt = paddle.optimizer.SGD(0.1, parameters=m.parameters())
    s = ap.Strategy()
    s.data_parallel.degree = world_size
    m, opt = ap.parallelize(m, opt, strategy=s)
    with count_collectives() as log:
        with ap.parallel_guard(["data"]):
            loss = F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
    return m, loss, log.counts(rank=0)


# ---- a loss is readable on one rank alone -------------------------------------------------------------------
def test_a_data_parallel_loss_is_replicated_when_made_and_reads_the_one_process_value():
    ref_loss, ref_grad = reference()
    with ap.simulate(world_size=2):
        m, loss, counts = dp_step()
        assert loss.placements == [ap.Replicate(), ap.Replicate()]
        for r in (0, 1):                                    # each rank's own copy is the global value
            assert float(loss.local_of(r)) == pytest.approx(ref_loss, rel=1e-6)
        with count_collectives() as reads:
            got = (loss.item(), float(loss), f"{loss:.6f}", bool(loss > 0), loss.numpy().tolist(), repr(loss))
        assert reads.calls == [], "a read makes no collective"
        assert got[0] == pytest.approx(ref_loss, rel=1e-6) and got[2] == f"{ref_loss:.6f}"
        assert f", value={got[0]!r})" in got[5]
        loss.backward()                                      # the all_reduce's adjoint: gradients unchanged
        grad = m.fc1.weight.grad
        np.testing.assert_allclose(grad.full().numpy() if hasattr(grad, "full") else grad.numpy(), ref_grad,
                                   rtol=1e-5, atol=1e-6)
    assert counts == {"all_reduce": 2}, "the forward's one extra collective: one scalar all_reduce"


def test_negative_control_without_the_settling_the_loss_stays_partial_and_a_read_is_a_collective(monkeypatch):
    monkeypatch.setenv("AP_SCALAR_REDUCE", "off")
    with ap.simulate(world_size=2):
        _, loss, counts = dp_step()
        assert loss.placements[0] == ap.Partial()
        with count_collectives() as reads:
            float(loss)
        assert reads.counts(rank=0) == {"all_reduce": 1}
    assert counts == {"all_reduce": 1}


@pytest.mark.parametrize("reduce,expect,grad", [("sum", 28.0, 1.0), ("mean", 3.5, 1 / 8), ("max", 7.0, None)])
def test_one_element_reductions_of_a_sharded_tensor_settle_and_larger_ones_keep_their_placement(reduce, expect, grad):
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        x = ap.shard_tensor(paddle.arange(8, dtype="float32").reshape([4, 2]), mesh, [ap.Shard(0)],
                            stop_gradient=False)
        one = getattr(paddle, reduce)(x)
        assert one.item() == pytest.approx(expect)
        if grad is not None:                              # sum / avg: replicated, gradient as one process's
            assert one.placements == [ap.Replicate()]
            (one * 3).backward(retain_graph=True)
            one.backward()                                # again: the graph holds no collective
            np.testing.assert_allclose(x.grad.numpy(), np.full([4, 2], 4 * grad), rtol=1e-6)
        rows = x.sum(axis=0)                              # two elements: the user's collective, left Partial
        assert rows.placements == [ap.Partial()]
        np.testing.assert_allclose(rows.numpy(), [12.0, 16.0])


def test_a_larger_or_unreplicated_tensor_prints_no_value_and_refuses_a_number_format():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        x = ap.shard_tensor(paddle.arange(8, dtype="float32").reshape([4, 2]), mesh, [ap.Shard(0)])
        assert "value=" not in repr(x) and f"{x}" == repr(x)
        with pytest.raises(TypeError, match="a DistTensor of 8 elements: only a one-element tensor formats"):
            f"{x:.2f}"


def test_the_check_is_off_by_default_and_on_when_asked(monkeypatch):
    monkeypatch.delenv("AP_COLLECTIVE_CHECK", raising=False)
    assert not agreement.enabled("gloo") and not agreement.enabled("nccl")
    monkeypatch.setenv("AP_COLLECTIVE_CHECK", "on")
    assert agreement.enabled("gloo") and agreement.enabled("nccl")
    monkeypatch.setenv("AP_COLLECTIVE_CHECK", "off")
    assert not agreement.enabled("gloo")


def test_the_settings_are_validated(monkeypatch):
    from autoparallel import read_value

    monkeypatch.setenv("AP_SCALAR_REDUCE", "sometimes")
    with pytest.raises(ValueError, match="AP_SCALAR_REDUCE must be 'on' or 'off', got 'sometimes'"):
        read_value.enabled()
    monkeypatch.setenv("AP_COLLECTIVE_CHECK", "maybe")
    with pytest.raises(ValueError, match="AP_COLLECTIVE_CHECK must be 'on' or 'off', got 'maybe'"):
        agreement.enabled()


# ---- the agreement records ----------------------------------------------------------------------------------
def test_a_record_round_trips_and_names_the_calling_path():
    def forward():                                   # the same model line reached from two places
        return agreement.user_site()

    train = forward()
    evaluate = forward()
    assert train.startswith("test_probe_rank_only_values.py:") and " < test_probe_rank_only_values.py:" in train
    assert train.split(" < ")[0] == evaluate.split(" < ")[0] and train != evaluate
    rec = agreement.record(7, "all_gather", train)
    assert rec.dtype == np.int64 and rec.shape == (agreement.WORDS,)
    count, digest, text = agreement.parse(rec)
    assert (count, text) == (7, f"all_gather@{train}"[:agreement.TEXT_BYTES])
    assert digest != agreement.parse(agreement.record(7, "all_gather", evaluate))[1]
    tail_differs = [agreement.record(1, "all_reduce", "x" * 500 + tail) for tail in "ab"]   # beyond the text
    assert agreement.parse(tail_differs[0])[2] == agreement.parse(tail_differs[1])[2]
    assert agreement.verdict([0, 1], tail_differs, 0) is not None, "the hash covers the whole path"


def test_the_verdict_accepts_equal_records_and_names_every_rank_otherwise():
    a, b = agreement.record(3, "all_reduce", "train.py:40 (main)"), agreement.record(3, "all_reduce", "train.py:52")
    assert agreement.verdict([0, 1], [a, a], 0) is None
    why = agreement.verdict([0, 1], [a, b], 1)
    assert "rank 0: collective #3 on this group, all_reduce@train.py:40 (main)" in why
    assert "rank 1: collective #3 on this group, all_reduce@train.py:52" in why and "every rank" in why
    later = agreement.record(4, "all_reduce", "train.py:40 (main)")       # same line, one collective ahead
    assert agreement.verdict([0, 1], [a, later], 0) is not None


# ---- two ranks as two threads over a fake paddle.distributed ----------------------------------------------
class FakeDist:
    """all_gather / all_reduce between threads, one per rank; logs every payload call."""

    class ReduceOp:
        SUM, MAX, MIN, AVG = "sum", "max", "min", "avg"

    def __init__(self, n):
        self.n, self.slots, self.calls = n, {}, []
        self.barrier = threading.Barrier(n, timeout=10)
        self.rank = threading.local()

    def _swap(self, t):
        self.slots[self.rank.r] = t.clone()
        self.barrier.wait()
        got = [self.slots[r] for r in range(self.n)]
        self.barrier.wait()
        return got

    def all_gather(self, out, t, group=None):
        self.calls.append(("all_gather", self.rank.r))
        out.extend(self._swap(t))

    def records(self, out, t, group=None):          # agreement.raw_all_gather: not a payload call
        out.extend(self._swap(t))

    def all_reduce(self, t, op=None, group=None):
        self.calls.append(("all_reduce", self.rank.r))
        t.set_value(paddle.add_n(self._swap(t)))


def run_ranks(fake, body, monkeypatch):
    """``body(transport, rank)`` on each rank's thread; returns {rank: result or exception}."""
    monkeypatch.setattr(agreement, "raw_all_gather", lambda: fake.records)
    out = {}

    def main(r):
        fake.rank.r = r
        t = RealTransport(r, "gloo")
        t._dist = lambda: fake
        t._group = lambda ranks: None
        try:
            out[r] = body(t, r)
        except Exception as e:             # noqa: BLE001  (the test inspects it)
            out[r] = e

    threads = [threading.Thread(target=main, args=(r,)) for r in range(fake.n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return out


@pytest.fixture
def fresh_counts(monkeypatch):
    monkeypatch.setattr(agreement, "_counts", {})
    monkeypatch.setenv("AP_COLLECTIVE_CHECK", "on")


def test_the_same_collective_on_every_rank_runs(fresh_counts, monkeypatch):
    fake = FakeDist(2)

    def every_rank(t, r):
        return float(t.all_reduce({r: paddle.to_tensor([float(r + 1)])}, [0, 1], "sum")[r])

    checks = agreement.stats()["checks"]
    assert run_ranks(fake, every_rank, monkeypatch) == {0: 3.0, 1: 3.0}
    assert sorted(fake.calls) == [("all_reduce", 0), ("all_reduce", 1)]
    assert agreement.stats()["checks"] == checks + 2, "one check per rank, counted apart from the payload"


def test_a_collective_on_one_rank_only_fails_on_every_rank_before_any_payload_moves(fresh_counts, monkeypatch):
    fake = FakeDist(2)

    def rank0_reads_while_rank1_trains(t, r):
        x = {r: paddle.to_tensor([float(r + 1)])}
        if r == 0:
            return t.all_reduce(x, [0, 1], "sum")            # rank 0's extra read
        return t.all_reduce(x, [0, 1], "sum")                # rank 1's next step: same kind, same bytes

    got = run_ranks(fake, rank0_reads_while_rank1_trains, monkeypatch)
    for r in (0, 1):
        assert isinstance(got[r], agreement.CollectiveMismatchError), got[r]
        assert "rank 0: collective #1 on this group, all_reduce@test_probe_rank_only_values.py:" in str(got[r])
        assert f"This rank is {r}" in str(got[r])
    assert fake.calls == [], "no payload was paired with another rank's collective"


def test_negative_control_with_the_check_off_the_mismatched_pair_silently_mixes_values(fresh_counts, monkeypatch):
    monkeypatch.setenv("AP_COLLECTIVE_CHECK", "off")
    fake = FakeDist(2)

    def mismatched(t, r):
        x = {r: paddle.to_tensor([1.0 if r == 0 else 100.0])}
        if r == 0:
            return float(t.all_reduce(x, [0, 1], "sum")[r])
        return float(t.all_reduce(x, [0, 1], "sum")[r])

    assert run_ranks(fake, mismatched, monkeypatch) == {0: 101.0, 1: 101.0}     # rank 0's read took rank 1's term


def test_a_save_entered_on_one_rank_only_meets_the_others_training_record(fresh_counts, monkeypatch):
    """save_state_dict's entry check compares the kind alone: any line may call it, but every rank must."""
    peer = {}

    def gather(out, t, group=None):                 # rank 1 sends the record of its next training collective
        mine = t.numpy()
        out.extend([paddle.to_tensor(mine), paddle.to_tensor(peer.get("record", mine))])

    monkeypatch.setattr(agreement, "raw_all_gather", lambda: gather)
    agreement.check_world("save_state_dict", 0, 2)                     # rank 1 saves too (its own line): fine
    peer["record"] = agreement.record(2, "all_reduce", "train.py:52")
    with pytest.raises(agreement.CollectiveMismatchError, match=r"rank 0: collective #2 on this group, "
                                                                r"save_state_dict@every rank; rank 1: .*all_reduce"):
        agreement.check_world("save_state_dict", 0, 2)
    calls = []
    monkeypatch.setattr(agreement, "raw_all_gather", lambda: calls.append)
    agreement.check_world("save_state_dict", 0, 1)                     # one process: nothing to agree on
    assert calls == []
