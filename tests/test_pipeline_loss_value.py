"""The value of a loss computed from a pipeline's logits (``loss_fn(model(x), y)``; external_loss.py,
value_cache.py, loss_sync.py), in the simulated world: ``loss.backward()`` keeps the value on the tensor, so
``float(loss)``, ``loss.item()``, ``loss.numpy()``, ``f"{loss:.6f}"`` and ``repr`` read it with no collective and
no gather, and it equals one process's loss; a read before backward keeps it too (a second read is local);
the one-element tensors the root was computed from (``loss`` of ``(loss / 2).backward()``) are kept too;
``detach()`` keeps it; a change in place drops it; a tensor computed from the loss afterwards is read as before
(a gather). The verdict of the tagged exchange that refuses a read on some ranks only on launched ranks (its
launched run: tests/test_probe_pipeline_zero_dist.py)."""
import contextlib

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import pp_common

import autoparallel as ap
from autoparallel.comm import collectives as _C
from autoparallel.dist_tensor import DistTensor
from autoparallel.parallel.pipeline import loss_sync


@contextlib.contextmanager
def counted(monkeypatch):
    """Every simulated collective and every ``DistTensor.full`` (a gather) run inside the block."""
    calls = []
    for n in [n for n in vars(_C) if n.endswith("_raw") and n != "_slice_raw"]:
        monkeypatch.setattr(_C, n, (lambda f, n: lambda *a, **k: (calls.append(n), f(*a, **k))[1])(getattr(_C, n), n))
    full = DistTensor.full
    monkeypatch.setattr(DistTensor, "full", lambda self: (calls.append("full"), full(self))[1])
    yield calls
    monkeypatch.undo()


def reference_loss(x, y) -> float:
    model = pp_common.build("gpt")
    return float(F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y)).mean())


def pipeline_loss(x, y):
    s = ap.Strategy()
    s.pipeline_parallel.degree, s.pipeline_parallel.micro_batches = 2, 4
    s.data_parallel.degree = 2
    m = pp_common.build("gpt")
    pipe, _ = ap.parallelize(m, paddle.optimizer.SGD(0.1, parameters=m.parameters()), strategy=s)
    return F.cross_entropy(pipe(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()


X, Y = pp_common.batches(1)[0]


def test_backward_keeps_the_value_and_every_read_is_local(monkeypatch):
    want = reference_loss(X, Y)
    with ap.simulate(world_size=4):
        loss = pipeline_loss(X, Y)
        loss.backward()
        with counted(monkeypatch) as calls:
            got = [float(loss), loss.item(), float(loss.numpy()), float(f"{loss:.6f}")]
            text = repr(loss)
        assert calls == []
        np.testing.assert_allclose(got, [want] * 4, rtol=1e-5, atol=1e-6)
        assert loss.numpy().shape == tuple(loss.shape) and f"value={got[0]!r}" in text
        with counted(monkeypatch) as calls:               # control: a tensor computed from it gathers
            doubled = float(loss * 2)
        assert "full" in calls
        np.testing.assert_allclose(doubled, 2 * want, rtol=1e-5)


def test_a_scaled_backward_keeps_the_loss_it_was_computed_from(monkeypatch):
    """``(loss / 2 + (loss * 3) * 0.0).backward()``: the root and every one-element tensor it was computed from
    (``loss``, ``loss / 2``, ``loss * 3``) are kept; a tensor computed from the loss after backward is not."""
    want = reference_loss(X, Y)
    with ap.simulate(world_size=4):
        loss = pipeline_loss(X, Y)
        half = loss / 2
        aux = loss * 3
        root = half + aux * 0.0
        root.backward()
        beside = loss * 5
        with counted(monkeypatch) as calls:
            got = [float(loss), float(half), float(root), float(aux)]
        assert calls == []
        np.testing.assert_allclose(got, [want, want / 2, want / 2, 3 * want], rtol=1e-5)
        with counted(monkeypatch) as calls:
            float(beside)
        assert "full" in calls


def test_a_grad_scaler_backward_keeps_the_loss(monkeypatch):
    """``scaler.scale(loss).backward()`` (GradScaler 1024): ``float(loss)`` afterwards is local. With float32
    parameters the scaler is disabled on a distributed loss (paddle's warning) and ``scale`` returns the loss;
    a scaled root (``loss * s``) is the case of ``loss / 2`` above. Paddle decides from its global AMP state, which
    building a PaddleFormers model leaves at float16 for the rest of the process: pinned at float32 here."""
    from paddle.amp.auto_cast import amp_global_state

    from autoparallel.testing.gpu_scaler import gpu_grad_scaler

    monkeypatch.setattr(amp_global_state(), "amp_dtype", "float32")
    with ap.simulate(world_size=4):
        loss = pipeline_loss(X, Y)
        scaled = gpu_grad_scaler(init_loss_scaling=1024).scale(loss)
        scaled.backward()
        with counted(monkeypatch) as calls:
            got = [float(loss), float(scaled)]
        assert calls == []
    np.testing.assert_allclose(got, [reference_loss(X, Y)] * 2, rtol=1e-5)


def test_a_read_before_backward_keeps_the_value(monkeypatch):
    with ap.simulate(world_size=4):
        loss = pipeline_loss(X, Y)
        with counted(monkeypatch) as calls:
            first = float(loss)
        assert "full" in calls                          # the first read gathers
        with counted(monkeypatch) as calls:
            second = loss.item()
        assert calls == [] and second == first
        loss.backward()
        assert float(loss) == first
    np.testing.assert_allclose(first, reference_loss(X, Y), rtol=1e-5)


def test_detach_keeps_the_value_and_a_change_in_place_drops_it(monkeypatch):
    with ap.simulate(world_size=4):
        loss = pipeline_loss(X, Y)
        loss.backward()
        value = float(loss)
        kept = loss.detach()
        with counted(monkeypatch) as calls:
            assert float(kept) == value
        assert calls == []
        kept.add_(paddle.to_tensor(1.0))                # a write into the storage both share: read again
        np.testing.assert_allclose(float(kept), value + 1.0, rtol=1e-6)
        np.testing.assert_allclose(float(loss), value + 1.0, rtol=1e-6)     # as paddle's detach shares storage
        with paddle.no_grad():
            loss.fill_(2.5)
        assert float(loss) == 2.5


def test_the_exchange_names_a_read_on_some_ranks_only():
    """Rank 0 read while ranks 1-3 were at loss.backward(): the summed counts differ on every rank."""
    summed = [a + b + c + d for a, b, c, d in zip(loss_sync.header("item", 0), loss_sync.header("backward", 1),
                                                   loss_sync.header("backward", 2), loss_sync.header("backward", 3))]
    why = loss_sync.verdict(summed, 4)
    assert "was read on 1 of 4 ranks [0] while 3 rank(s) were at loss.backward() and 0 at the pipeline's next" in why
    assert why.endswith("Fix: " + loss_sync.FIX) and "call float(loss) after loss.backward(), or on every rank" in why
    for kind in loss_sync.KINDS:
        agreed = [sum(w) for w in zip(*(loss_sync.header(kind, r) for r in range(4)))]
        assert loss_sync.verdict(agreed, 4) is None
    assert issubclass(loss_sync.LossReadOnSomeRanksError, RuntimeError)
    assert loss_sync.LossReadOnSomeRanksError.every_rank_knows
    with pytest.raises(ValueError, match="carries 12 values, got 13"):
        loss_sync.exchange("backward", [0.0] * 13)
