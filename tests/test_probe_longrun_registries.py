"""Long runs: after warm-up, a training step adds nothing to any registry, cache or side table of the package
(every module-level container of ``autoparallel``, ``spmd_rules`` and ``reshard`` is counted), nor hooks on
layers, nor threads. The memo of shared gradient reductions forgets by age and is checked against its bound."""
import gc
import sys
import threading
import weakref

import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.compat import SideData
from autoparallel.testing.models import adamw, batch, build, tp_plan

PACKAGES = ("autoparallel", "spmd_rules", "reshard")
BY_AGE = {"autoparallel.comm.fanout._MEMO", "autoparallel.comm.fanout._ORDER"}   # bounded by fanout._LIMIT
                                                                                  # insertions, not by steps
CONTAINERS = (dict, list, set, SideData, weakref.WeakSet, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)


def registry_sizes() -> dict:
    """{module.name: len} of every module-level container (and of the dicts inside a dict) in the packages."""
    from collections import deque

    out = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or name.split(".")[0] not in PACKAGES:
            continue
        for attr, v in list(vars(mod).items()):
            if attr.startswith("__") or not isinstance(v, CONTAINERS + (deque,)):
                continue
            out[f"{name}.{attr}"] = len(v)
            if isinstance(v, dict):
                for k, inner in list(v.items()):
                    if isinstance(inner, (dict, list, set)):
                        out[f"{name}.{attr}[{k!r:.40}]"] = len(inner)
    return out


def hook_count(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_post_hooks) for m in model.sublayers(include_self=True))


def snapshot(model) -> dict:
    gc.collect()
    out = registry_sizes()
    out["hooks on layers"] = hook_count(model)
    out["threads"] = threading.active_count()
    return out


def grown(before: dict, after: dict) -> dict:
    return {k: (before.get(k, 0), n) for k, n in after.items() if n > before.get(k, 0) and k not in BY_AGE}


def _strategy(kind):
    s = ap.Strategy()
    if kind == "dp2-tp2-sp":
        s.data_parallel.degree, s.tensor_parallel.degree = 2, 2
        s.sequence_parallel.enable = True
    else:
        s.data_parallel.degree = 2
        s.sharding.enable, s.sharding.stage = True, 3
    return s


@pytest.mark.parametrize("kind,world", [("dp2-tp2-sp", 4), ("zero3-dp2", 2)])
def test_steps_after_warm_up_grow_no_registry(kind, world):
    from autoparallel.comm import fanout

    with ap.simulate(world_size=world):
        m = build("gpt")
        kw = {"tp_plan": tp_plan("gpt")} if "tp" in kind else {}
        m, opt = ap.parallelize(m, adamw(m.parameters()), strategy=_strategy(kind), **kw)

        def step(i):
            ids, lab = batch(i % 3)
            loss = F.cross_entropy(m(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()

        for i in range(4):
            step(i)
        before = snapshot(m)
        for i in range(4, 24):
            step(i)
        after = snapshot(m)
    assert grown(before, after) == {}
    assert max(after[k] for k in BY_AGE if k in after) <= fanout._LIMIT
    assert len(fanout._MEMO) == 0           # every shared input went with its backward or its sources


def test_recompute_keeps_no_shared_input_after_the_step():
    """Recompute's re-run forward builds shared inputs whose backward never runs: they go with their sources
    (they were kept, with their graphs, for 256 more insertions), and training equals one process."""
    import numpy as np

    from autoparallel.comm import fanout
    from autoparallel.testing.models import trained_reference

    want_losses, want = trained_reference("gpt", steps=3)
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = 2, 2
    s.recompute.enable = True
    with ap.simulate(world_size=4):
        m = build("gpt")
        m, opt = ap.parallelize(m, adamw(m.parameters()), strategy=s, tp_plan=tp_plan("gpt"))
        losses = []
        for i in range(3):
            ids, lab = batch(i)
            loss = F.cross_entropy(m(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
        del loss
        gc.collect()
        assert len(fanout._MEMO) == 0
        got = {n: p.full().numpy() for n, p in m.named_parameters()}
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4, atol=1e-6)
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-4, atol=2e-5, err_msg=n)


def test_the_count_sees_a_table_that_grows_per_step():
    """Negative control: a side table filled once per step is reported."""
    from autoparallel import layer_state

    with ap.simulate(world_size=2):
        m = build("gpt")
        before = snapshot(m)
        kept = [paddle.nn.Linear(2, 2) for _ in range(3)]
        for i, layer in enumerate(kept):
            layer_state.put(layer, "mesh", i)
            m.register_forward_post_hook(lambda *a: None)
        after = snapshot(m)
    assert grown(before, after) == {"autoparallel.layer_state._STATE": (before["autoparallel.layer_state._STATE"],
                                                                       before["autoparallel.layer_state._STATE"] + 3),
                                    "hooks on layers": (before["hooks on layers"], before["hooks on layers"] + 3)}
