"""A plain paddle optimizer over a layer distributed with ap.shard_layer trains like one process, whether it was
built before or after shard_layer, with or without ap.shard_optimizer, with parameter groups, and under paddle's
GradScaler; an optimizer that already stepped before distribution, a closure step and minimize are refused."""
import warnings

import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.parallel.stale_optimizers import StaleOptimizerError


def _model():
    paddle.seed(0)
    return paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.ReLU(), paddle.nn.Linear(8, 2))


def _data():
    paddle.seed(1)
    return paddle.randn([6, 4]), paddle.randn([6, 2])


def _opt(cls, m, groups):
    params = [{"params": list(m.parameters())}] if groups else m.parameters()
    return cls(learning_rate=0.1, parameters=params)


def _single(cls, groups, steps=3):
    m, (x, y) = _model(), _data()
    opt, out = _opt(cls, m, groups), []
    for _ in range(steps):
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        out.append(float(loss))
    return out, [p.numpy() for p in m.parameters()]


def _distributed(cls, groups, before, wrap, steps=3, accumulate=1):
    m, (x, y) = _model(), _data()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        opt = _opt(cls, m, groups) if before else None
        ap.shard_layer(m, mesh)
        opt = opt or _opt(cls, m, groups)
        opt = ap.shard_optimizer(opt) if wrap else opt
        dx, dy = (ap.shard_tensor(t, mesh, [ap.Shard(0)]) for t in (x, y))
        out = []
        for _ in range(steps):
            for _ in range(accumulate):
                loss = ((m(dx) - dy) ** 2).mean()
                loss.backward()
            opt.step()
            opt.clear_grad()
            out.append(float(loss.full().numpy()))
        return out, [p.full().numpy() if hasattr(p, "full") else p.numpy() for p in m.parameters()]


@pytest.mark.parametrize("cls", [paddle.optimizer.AdamW, paddle.optimizer.SGD, paddle.optimizer.Momentum])
@pytest.mark.parametrize("before", [False, True], ids=["built_after", "built_before"])
@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "shard_optimizer"])
def test_trains_like_one_process(cls, before, wrap):
    ref_loss, ref_params = _single(cls, groups=False)
    loss, params = _distributed(cls, groups=False, before=before, wrap=wrap)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(params, ref_params):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert loss[-1] < loss[0]                                   # it trains at all


def test_parameter_groups_built_before():
    ref_loss, _ = _single(paddle.optimizer.AdamW, groups=True)
    loss, _ = _distributed(paddle.optimizer.AdamW, groups=True, before=True, wrap=False)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)


def test_two_backwards_before_a_plain_step_accumulate_like_paddle():
    m, (x, y) = _model(), _data()
    opt = _opt(paddle.optimizer.SGD, m, False)
    for _ in range(2):
        ((m(x) - y) ** 2).mean().backward()
    opt.step()
    ref = [p.numpy() for p in m.parameters()]
    _, params = _distributed(paddle.optimizer.SGD, False, before=False, wrap=False, steps=1, accumulate=2)
    for a, b in zip(params, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _grads_read_before_each_step(before, accumulate, world=2):
    """The gradients a user reads between backward and step (a grad-norm log), every step: one process's, or
    the simulated ranks' copies of them (every rank's ``p.grad``)."""
    m, (x, y) = _model(), _data()
    reads = []
    if world is None:
        opt = _opt(paddle.optimizer.SGD, m, False)
        dx, dy = x, y
    else:
        ctx = ap.simulate(world_size=world)
        ctx.__enter__()
        mesh = ap.ProcessMesh(list(range(world)), dim_names=["dp"])
        opt = _opt(paddle.optimizer.SGD, m, False) if before else None
        ap.shard_layer(m, mesh)
        opt = opt or _opt(paddle.optimizer.SGD, m, False)
        dx, dy = (ap.shard_tensor(t, mesh, [ap.Shard(0)]) for t in (x, y))
    try:
        for _ in range(3):
            for _ in range(accumulate):
                ((m(dx) - dy) ** 2).mean().backward()
                if world is None:
                    reads.append([p.grad.numpy() for p in m.parameters()])
                else:
                    reads.append([[t.grad.numpy() for t in p._ap_locals.values()] for p in m.parameters()])
            opt.step()
            opt.clear_grad()
    finally:
        if world is not None:
            ctx.__exit__(None, None, None)
    return reads


@pytest.mark.parametrize("before", [False, True], ids=["built_after", "built_before"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_p_grad_read_before_a_plain_step_is_the_sum_over_the_ranks(before, accumulate):
    """``p.grad`` of a data-parallel parameter read between backward and a plain optimizer's step (a grad-norm
    log): before its first step the optimizer had no wrapper, and between later steps its wrapper reduced at the
    step only, so each rank read its own partial sum (paddle's ``p.grad.numpy()`` is the sum). The wrapper is now
    made as the first backward starts and reduces from its hooks: every rank reads one process's gradient after
    each step's backward. With two backward passes per step the reduction runs once per window, after its last
    backward, once the window's length is known (the first step's): reads 0 (one backward seen so far), 3 and 5;
    the others hold partial sums until the step, as under ``ap.shard_optimizer`` (reducer.py)."""
    ref = _grads_read_before_each_step(before, accumulate, world=None)
    got = _grads_read_before_each_step(before, accumulate)
    for i, (want, have) in enumerate(zip(ref, got)):
        if accumulate == 2 and i not in (0, 3, 5):
            continue
        for w, copies in zip(want, have):
            for c in copies:
                np.testing.assert_allclose(c, w, rtol=1e-5, atol=1e-6, err_msg=f"read {i}")


def test_negative_control_the_original_parameters_do_not_train():
    """Without pointing the optimizer at the distributed parameters the model would not train: the originals
    it held get no gradient (what happened before shard_layer re-pointed optimizers)."""
    m, (x, y) = _model(), _data()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        originals = list(m.parameters())
        ap.shard_layer(m, mesh)
        stale = paddle.optimizer.SGD(learning_rate=0.1, parameters=originals)
        dx, dy = (ap.shard_tensor(t, mesh, [ap.Shard(0)]) for t in (x, y))
        losses = []
        for _ in range(2):
            loss = ((m(dx) - dy) ** 2).mean()
            loss.backward()
            with ap.local_mode():
                stale.step()
            losses.append(float(loss.full().numpy()))
    assert losses[0] == losses[1]


def test_an_optimizer_that_already_stepped_is_refused():
    m, (x, y) = _model(), _data()
    opt = _opt(paddle.optimizer.AdamW, m, False)
    ((m(x) - y) ** 2).mean().backward()
    opt.step()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        with pytest.raises(StaleOptimizerError, match="already stepped"):
            ap.shard_layer(m, mesh)


def test_closure_step_and_partial_minimize_are_refused():
    m, (x, y) = _model(), _data()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        ap.shard_layer(m, mesh)
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=m.parameters())
        dx, dy = (ap.shard_tensor(t, mesh, [ap.Shard(0)]) for t in (x, y))
        loss = ((m(dx) - dy) ** 2).mean()
        with pytest.raises(NotImplementedError, match="minimize"):
            opt.minimize(loss, parameters=list(m.parameters())[:1])     # minimize(loss): tests/test_probe_api_*
        with pytest.raises(NotImplementedError, match="closure"):
            opt.step(lambda: loss)


def test_grad_scaler_over_a_plain_optimizer():
    ref_loss, ref_params = _single(paddle.optimizer.SGD, groups=False, steps=2)
    m, (x, y) = _model(), _data()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        ap.shard_layer(m, mesh)
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=m.parameters())
        scaler = paddle.amp.GradScaler(init_loss_scaling=8.0)
        dx, dy = (ap.shard_tensor(t, mesh, [ap.Shard(0)]) for t in (x, y))
        for _ in range(2):
            loss = ((m(dx) - dy) ** 2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.clear_grad()
        params = [p.full().numpy() for p in m.parameters()]
    for a, b in zip(params, ref_params):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_partial_gradients_no_optimizer_holds_are_said_once(monkeypatch):
    """Without any optimizer over them, nothing reduces data-parallel gradients: ``p.grad`` holds each rank's part
    (paddle's ``p.grad.numpy()`` would gather the sum). A UserWarning names them, once; with an optimizer, none."""
    from autoparallel.parallel import implicit_optimizer

    def run(with_opt):
        monkeypatch.setattr(implicit_optimizer, "_WARNED", [])
        m, (x, y) = _model(), _data()
        with ap.simulate(world_size=2), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
            ap.shard_layer(m, mesh)
            opt = _opt(paddle.optimizer.SGD, m, False) if with_opt else None
            dx, dy = (ap.shard_tensor(t, mesh, [ap.Shard(0)]) for t in (x, y))
            for _ in range(2):
                ((m(dx) - dy) ** 2).mean().backward()
            del opt
        return [str(w.message) for w in seen if "held by no optimizer" in str(w.message)]

    said = run(with_opt=False)
    assert len(said) == 1 and said[0].startswith("4 data-parallel parameter(s)") and "this rank's part" in said[0]
    assert run(with_opt=True) == []


def test_a_plain_optimizer_replacing_a_live_ap_one_reduces_once():
    """The optimizer ``ap.shard_optimizer`` returned is kept alive (a reference in the user's loop state) and a
    plain paddle optimizer over the same parameters replaces it: both reductions acted on the gradients (twice the
    sum from the second step on). The plain one's wrapper now takes the parameters over at its first step."""
    ref_loss, ref_params = _single(paddle.optimizer.SGD, groups=False)
    m, (x, y) = _model(), _data()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        ap.shard_layer(m, mesh)
        kept = ap.shard_optimizer(_opt(paddle.optimizer.SGD, m, False))
        opt = _opt(paddle.optimizer.SGD, m, False)
        dx, dy = (ap.shard_tensor(t, mesh, [ap.Shard(0)]) for t in (x, y))
        losses = []
        for _ in range(3):
            loss = ((m(dx) - dy) ** 2).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss.full().numpy()))
        params = [p.full().numpy() for p in m.parameters()]
    assert kept is not None
    np.testing.assert_allclose(losses, ref_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(params, ref_params):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_reference_model_run_under_no_grad_is_not_named_and_trains_as_one_process(monkeypatch):
    """DPO's form: a reference model (trainable parameters, no optimizer) runs its forward under ``paddle.no_grad``
    next to the trained model. A use without a graph adds nothing to a gradient, so dispatch no longer marks its
    parameters partial: they were named as unheld data-parallel parameters on every step's backward. The trained
    model's values equal one process; a reference model run WITH a graph is still named (the control)."""
    from autoparallel.parallel import implicit_optimizer

    def run(ref_grad):
        monkeypatch.setattr(implicit_optimizer, "_WARNED", [])
        m, (x, y) = _model(), _data()
        ref = _model()
        losses = []
        with ap.simulate(world_size=2), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
            ap.shard_layer(m, mesh)
            ap.shard_layer(ref, mesh)
            opt = _opt(paddle.optimizer.SGD, m, False)
            dx, dy = (ap.shard_tensor(t, mesh, [ap.Shard(0)]) for t in (x, y))
            for _ in range(3):
                if ref_grad:
                    target = ref(dx).detach()
                else:
                    with paddle.no_grad():
                        target = ref(dx)
                loss = ((m(dx) - dy) ** 2).mean() + 0.0 * (target ** 2).mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                losses.append(float(loss.full().numpy()))
        return losses, [str(w.message) for w in seen if "held by no optimizer" in str(w.message)]

    ref_loss, _ = _single(paddle.optimizer.SGD, groups=False)
    losses, said = run(ref_grad=False)
    np.testing.assert_allclose(losses, ref_loss, rtol=1e-5, atol=1e-6)
    assert said == []
    assert len(run(ref_grad=True)[1]) == 1
