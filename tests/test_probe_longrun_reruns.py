"""Notebook re-runs in one process: model A is parallelized and trained, then model B (same class on the same
mesh, another class, another world): B equals one process, A is released once dropped (its weak reference
dies after ``gc.collect()``), ``ap.uninstall()`` then succeeds; parallelizing one model twice is refused with a
typed error; a step whose forward raises leaves nothing that corrupts the next one."""
import gc
import weakref

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.testing.models import adamw, batch, build, tp_plan, trained_reference

_REFS = {}


def ref(kind):
    if kind not in _REFS:
        _REFS[kind] = trained_reference(kind, steps=3)
    return _REFS[kind]


def parallel(kind, dp, tp=1, zero=0):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    if zero:
        s.sharding.enable, s.sharding.stage = True, zero
    m = build(kind)
    return ap.parallelize(m, adamw(m.parameters()), strategy=s, **({"tp_plan": tp_plan(kind)} if tp > 1 else {}))


def train(m, opt, steps=3, fail_at=None):
    """``steps`` steps on batch(0), batch(1), ...; before step ``fail_at`` a forward raises inside the model."""
    losses = []
    for i in range(steps):
        if i == fail_at:
            with pytest.raises(RuntimeError, match="user code"):
                _forward_that_raises(m)
        ids, lab = batch(i)
        loss = F.cross_entropy(m(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def _forward_that_raises(m):
    block = m.blocks[1]

    def boom(layer, inputs):
        raise RuntimeError("user code raised inside forward")

    handle = block.register_forward_pre_hook(boom)
    try:
        ids, lab = batch(99)
        F.cross_entropy(m(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean().backward()
    finally:
        handle.remove()


def assert_equals_one_process(kind, m, losses):
    want_losses, want = ref(kind)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4, atol=1e-6)
    for n, p in m.named_parameters():
        np.testing.assert_allclose(p.full().numpy(), want[n], rtol=1e-4, atol=2e-5, err_msg=n)


def test_rerun_cells_release_the_old_model_and_train_the_new_one_exactly():
    with ap.simulate(world_size=4):
        a, opt_a = parallel("gpt", 2, 2)
        assert_equals_one_process("gpt", a, train(a, opt_a))
        gone_a = weakref.ref(a)
        gone_params = [weakref.ref(p) for p in a.parameters()]
        b, opt_b = parallel("gpt", 2, 2)                    # the same class on the same mesh
        del a, opt_a
        gc.collect()
        assert gone_a() is None
        assert [r() for r in gone_params if r() is not None] == []     # with every distributed parameter
        assert_equals_one_process("gpt", b, train(b, opt_b))
        c, opt_c = parallel("llama", 4, zero=2)             # another class, another mesh
        assert_equals_one_process("llama", c, train(c, opt_c))
    with ap.simulate(world_size=2):                         # another world
        d, opt_d = parallel("gpt", 2, zero=3)
        assert_equals_one_process("gpt", d, train(d, opt_d))
    gone = [weakref.ref(x) for x in (b, c, d, opt_b, opt_c, opt_d)]
    del b, c, d, opt_b, opt_c, opt_d
    gc.collect()
    assert [r() is None for r in gone] == [True] * 6
    assert ap.uninstall() > 0                               # no live layer holds a distributed parameter
    from autoparallel.auto_checkpoint import current_run

    assert current_run() is None                            # the current run went with its model


def test_parallelizing_the_same_model_twice_is_refused():
    with ap.simulate(world_size=4):
        m = build("gpt")
        opt = adamw(m.parameters())
        s = ap.Strategy()
        s.data_parallel.degree = 4
        out, opt2 = ap.parallelize(m, opt, strategy=s)
        for again in (m, out):
            with pytest.raises(ValueError, match="already parallelized on ProcessMesh.*build a fresh model"):
                ap.parallelize(again, opt2, strategy=s)
        assert_equals_one_process("gpt", out, train(out, opt2))       # the refusal changed nothing


@pytest.mark.parametrize("dp,tp,zero", [(2, 2, 0), (4, 1, 3)])
def test_a_forward_that_raises_does_not_corrupt_the_next_step(dp, tp, zero):
    with ap.simulate(world_size=4):
        m, opt = parallel("gpt", dp, tp, zero)
        assert_equals_one_process("gpt", m, train(m, opt, fail_at=1))


def test_a_distributed_parameter_is_freed_when_dropped():
    """A DistParameter is its own rank's local; paddle hides a tensor's attributes from the garbage collector,
    so a parameter whose table of locals held itself was never freed."""
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        p = ap.shard_tensor(paddle.create_parameter([4, 2], "float32"), mesh, [ap.Shard(0)])
        assert p._ap_locals[0] is p and p.locals[1].shape == [2, 2]
        gone = weakref.ref(p)
        del p
        gc.collect()
        assert gone() is None
