"""Sequence length and batch size changing every step (lengths 17..128, a smaller last batch) under DP, TP,
SP and ZeRO: every step's loss and the final parameters equal one process. The dispatch tables stay within
their bound: when full they keep the plans hit since the last shrink (second chance) rather than emptying."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel import dispatch_cache
from autoparallel.testing.models import adamw, tp_plan

SHAPES = [(8, 17), (8, 128), (8, 33), (8, 64), (8, 17), (5, 40)]      # (batch, sequence length) per step


def build():
    from examples.models import GPT, GPTConfig

    paddle.seed(0)
    return GPT(GPTConfig(vocab_size=64, hidden=32, layers=2, heads=4, max_positions=128))


def batches():
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 64, s), rng.integers(0, 64, s)) for s in SHAPES]


def train(m, opt):
    losses = []
    for x, y in batches():
        loss = F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


_REF = []


def reference():
    if not _REF:
        m = build()
        _REF.extend([train(m, adamw(m.parameters())), {n: p.numpy() for n, p in m.named_parameters()}])
    return _REF


@pytest.mark.parametrize("layout", ["dp4", "tp4", "dp2-tp2-sp", "zero3-dp4"])
def test_variable_shapes_every_step_equal_one_process(layout):
    want_losses, want = reference()
    s = ap.Strategy()
    kw = {}
    if layout.startswith("tp") or "tp2" in layout:
        kw["tp_plan"] = tp_plan("gpt")
    s.data_parallel.degree = {"dp4": 4, "tp4": 1, "dp2-tp2-sp": 2, "zero3-dp4": 4}[layout]
    s.tensor_parallel.degree = {"tp4": 4, "dp2-tp2-sp": 2}.get(layout, 1)
    s.sequence_parallel.enable = layout.endswith("sp")
    if layout.startswith("zero"):
        s.sharding.enable, s.sharding.stage = True, 3
    with ap.simulate(world_size=4):
        m = build()
        m, opt = ap.parallelize(m, adamw(m.parameters()), strategy=s, **kw)
        losses = train(m, opt)
        got = {n: p.full().numpy() for n, p in m.named_parameters()}
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4, atol=1e-6)
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=2e-4, atol=3e-5, err_msg=n)


class _Plan:
    used = False


def test_a_full_table_keeps_the_plans_in_use(monkeypatch):
    """Limit 8: plans hit since the last shrink survive it, the table never exceeds its limit; emptying the
    table when full (the old policy, the negative control) would have dropped the hot plans."""
    monkeypatch.setattr(dispatch_cache, "_CACHE", {})
    monkeypatch.setattr(dispatch_cache, "_CACHE_LIMIT", 8)
    hot = {("hot", i): _Plan() for i in range(3)}
    for k, p in hot.items():
        dispatch_cache._CACHE[k] = p
    sizes = []
    for i in range(40):                                      # a new shape every call; the hot plans hit each time
        for k in hot:
            assert dispatch_cache._CACHE.get(k) is hot[k]
            hot[k].used = True                               # what find() does on a hit
        dispatch_cache.store(("cold", i), _Plan())
        sizes.append(len(dispatch_cache._CACHE))
    assert max(sizes) <= 8 and min(sizes[10:]) >= 6          # shrunk to 3/4, never emptied
    assert all(k in dispatch_cache._CACHE for k in hot)
    assert ("cold", 39) in dispatch_cache._CACHE and ("cold", 0) not in dispatch_cache._CACHE


def test_find_marks_a_hit_and_a_miss_leaves_no_entry(monkeypatch):
    from autoparallel.comm.world import current_world

    monkeypatch.setattr(dispatch_cache, "_CACHE", {})
    world = current_world()
    key, plan = dispatch_cache.find("rule", "paddle.add", world, (("x",), ()))
    assert plan is None and len(dispatch_cache._CACHE) == 0
    p = _Plan()
    dispatch_cache.store(key, p)
    assert not p.used
    assert dispatch_cache.find("rule", "paddle.add", world, (("x",), ()))[1] is p and p.used
