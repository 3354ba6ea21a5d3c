"""Notebook-style re-runs in one process, in the simulated world (world sizes alternating) and on 2 real ranks
(tests/dist_scripts/leaks7_worker.py): every round (``ap.parallelize`` DP / ZeRO-3, ``shard_layer`` +
``shard_optimizer(ShardingStage3)``) equals one process, leaves none of its models, optimizers or parameters
alive, and a repeated cycle of rounds grows no registry of the package. A model made in ``ap.simulate`` and
used outside it is refused with a typed error naming the cause; used in a bigger simulated world it trains
exactly as one process; in a smaller one it is refused."""
import os

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.testing.models import adamw, batch, build, trained_reference
from dist_scripts import shared_launch
from leaks7_worker import KINDS, STEPS, distributed, rounds

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_scripts", "leaks7_worker.py")
JOB = shared_launch.job(__name__, "leaks7", WORKER, 2, timeout=200)


@pytest.fixture(scope="module")
def reference():
    return trained_reference("gpt", STEPS)


def check_rounds(got, reference):
    want_losses = reference[0]
    cycle = len(KINDS)
    for r in got:
        np.testing.assert_allclose(r["losses"], want_losses, rtol=1e-4, atol=1e-6, err_msg=str(r["kind"]))
        assert r["alive"] == 0, r["kind"]                   # the model, its optimizer, every parameter
    assert len({r["optimizers"] for r in got}) == 1         # no optimizer accumulates
    for a, b in zip(got[cycle:], got[2 * cycle:]):          # the same round again grows no registry
        grown = {k: (a["sizes"].get(k, 0), n) for k, n in b["sizes"].items() if n > a["sizes"].get(k, 0)}
        assert grown == {}, (b["kind"], b["world"], grown)


def test_rounds_in_alternating_simulated_worlds_leave_nothing_behind(reference):
    plan = [("zero3", 2), ("dp", 4), ("shard_layer", 2)] * 2 + [("zero3", 2), ("dp", 4), ("shard_layer", 2)]
    got = rounds(plan, lambda w: ap.simulate(world_size=w))
    check_rounds(got, reference)


def test_rounds_on_two_real_ranks_leave_nothing_behind(reference):
    out, ranks = shared_launch.results(JOB)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        check_rounds(r["rounds"], reference)


def _step(m, opt, i):
    ids, lab = batch(i)
    loss = F.cross_entropy(m(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
    return float(loss)


@pytest.mark.parametrize("kind", ["zero3", "shard_layer"])
def test_a_simulated_model_used_outside_its_world_is_refused_with_the_cause(kind):
    """The real transport was handed every simulated rank's local and failed unpacking them:
    ``ValueError: too many values to unpack (expected 1)``."""
    with ap.simulate(world_size=2):
        m, opt, _ = distributed(kind, 2)
        _step(m, opt, 0)
    with pytest.raises(ValueError, match=r"locals of ranks \[0, 1\].*made in ap.simulate.*used outside it"):
        _step(m, opt, 1)


def test_a_model_moves_to_a_bigger_simulated_world_but_not_a_smaller_one():
    ref = build("gpt")
    ref_opt = adamw(ref.parameters())
    want = [_step(ref, ref_opt, i) for i in range(2)]
    with ap.simulate(world_size=2):
        m, opt, _ = distributed("zero3", 2)
        got = [_step(m, opt, 0)]
    with ap.simulate(world_size=4):                     # the mesh [0, 1] is part of this world
        got.append(_step(m, opt, 1))
        for n, p in ref.named_parameters():
            np.testing.assert_allclose(dict(m.named_parameters())[n].full().numpy(), p.numpy(), rtol=1e-4,
                                       atol=2e-5, err_msg=n)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    with ap.simulate(world_size=4):
        big, big_opt, _ = distributed("dp", 4)
    with ap.simulate(world_size=2), pytest.raises(ValueError, match=r"ranks \[2, 3\] are outside the simulated"):
        _step(big, big_opt, 0)


def test_a_dropped_pipeline_is_freed_with_its_parameters():
    """The current run kept its hook handle, the handle the optimizer's hooks, and one hook (the pipeline's step
    counter) the pipeline: after ``del model, opt`` the last pipeline and its parameters stayed alive."""
    import gc
    import weakref

    from autoparallel.auto_checkpoint import current_run

    with ap.simulate(world_size=4):
        s = ap.Strategy()
        s.data_parallel.degree, s.pipeline_parallel.degree = 2, 2
        m = build("gpt")
        m, opt = ap.parallelize(m, adamw(m.parameters()), strategy=s)
        ids, lab = batch(0)
        m.train_batch(paddle.to_tensor(ids), paddle.to_tensor(lab))
        opt.step()
        opt.clear_grad()
        assert m.steps_taken == 1                           # the step counter hook ran
        gone = [weakref.ref(m), weakref.ref(opt)] + [weakref.ref(p) for p in m.parameters()]
        del m, opt
    gc.collect()
    assert sum(r() is not None for r in gone) == 0
    assert current_run() is None
