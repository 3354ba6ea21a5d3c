"""Recompute full (every 1 and 2 layers) and selective on the tiny GPT and LLaMA: the same loss and
gradients as without recompute, fewer saved-activation bytes (printed), and clear errors."""
import dataclasses
import time

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.parallel.recompute import SavedBytes, apply_ac, recompute_layers
from autoparallel.parallelize import parallelize
from examples.models import PRESETS, build


def tiny(name="gpt-tiny"):
    paddle.seed(0)
    return build(dataclasses.replace(PRESETS[name], vocab_size=256, layers=4, max_positions=32))


def data():
    rng = np.random.default_rng(0)
    return paddle.to_tensor(rng.integers(0, 256, (4, 32))), paddle.to_tensor(rng.integers(0, 256, (4, 32)))


def run(m):
    x, y = data()
    with SavedBytes() as s:
        loss = F.cross_entropy(m(x), y)
    t0 = time.perf_counter()
    loss.backward()
    return float(loss), {n: p.grad.numpy() for n, p in m.named_parameters()}, s.bytes, time.perf_counter() - t0


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_same_loss_grads_fewer_saved_bytes(name):
    ref_loss, ref_grads, ref_bytes, ref_t = run(tiny(name))
    rows = [("none", ref_bytes, ref_t)]
    for gran, n in (("full", 1), ("full", 2), ("selective", 1)):
        loss, grads, nbytes, t = run(apply_ac(tiny(name), gran, n))
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        for k, g in ref_grads.items():
            np.testing.assert_allclose(grads[k], g, rtol=1e-5, atol=1e-7, err_msg=f"{gran}/{n}: {k}")
        assert nbytes < ref_bytes, (gran, n, nbytes, ref_bytes)
        rows.append((f"{gran}/{n}", nbytes, t))
    print(f"\n{name} saved activation bytes / backward s:", rows)
    d = dict((r[0], r[1]) for r in rows)
    assert d["full/2"] < d["full/1"] < d["selective/1"] < d["none"]


def test_recompute_layers_seed_style_and_distributed():
    ref_loss, ref_grads, _, _ = run(tiny())
    loss, grads, _, _ = run(recompute_layers(tiny(), lambda m: list(m.blocks), checkpoint_every_n_layers=2))
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    x, y = data()
    s = ap.Strategy()
    s.data_parallel.degree = 2
    with ap.simulate(world_size=2):                          # DistTensor activations through recompute
        m = apply_ac(tiny(), "full", 1)
        m, opt = parallelize(m, paddle.optimizer.AdamW(parameters=m.parameters()), strategy=s)
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.reduce_gradients()
        assert float(loss) == pytest.approx(ref_loss, rel=1e-6)
        for n, p in m.named_parameters():
            np.testing.assert_allclose(p.as_dist().grad.full().numpy(), ref_grads[n], rtol=1e-4, atol=1e-6)


def test_bad_input():
    with pytest.raises(ValueError, match="granularity must be one of"):
        apply_ac(tiny(), "partial")
    with pytest.raises(ValueError, match="checkpoint_every_n_layers must be an int >= 1, got 0"):
        apply_ac(tiny(), "full", 0)
    with pytest.raises(ValueError, match="LayerList"):
        apply_ac(paddle.nn.Linear(2, 2))


def test_recompute_layers_per_layer_predicate_as_in_the_article():
    from examples.models.gpt import Block

    ref_loss, ref_grads, ref_bytes, _ = run(tiny())
    m = tiny()
    reruns = []
    for b in m.blocks:
        b.mlp.register_forward_post_hook(lambda *_: reruns.append(1))
    m = recompute_layers(m, segment_func=lambda layer: isinstance(layer, Block), checkpoint_every_n_layers=2)
    loss, grads, nbytes, _ = run(m)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for k, g in ref_grads.items():
        np.testing.assert_allclose(grads[k], g, rtol=1e-5, atol=1e-7, err_msg=k)
    assert len(reruns) == 2 * len(m.blocks)                  # every block's forward ran again in backward
    every1 = run(recompute_layers(tiny(), segment_func=lambda l: isinstance(l, Block), checkpoint_every_n_layers=1))
    assert nbytes < every1[2] < ref_bytes                     # two blocks per segment keep fewer inputs


def test_recompute_layers_predicate_groups_only_chained_siblings():
    class Two(paddle.nn.Layer):                               # matches that are not one chain: one segment each
        def __init__(self):
            super().__init__()
            self.a, self.b = paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x) + self.b(x)                      # b does not take a's output

    paddle.seed(0)
    m = Two()
    x = paddle.rand([2, 4])
    want = m(x).numpy()
    recompute_layers(m, segment_func=lambda l: isinstance(l, paddle.nn.Linear), checkpoint_every_n_layers=2)
    np.testing.assert_allclose(m(x).numpy(), want, rtol=1e-6)  # grouping a and b would pass x through b


@pytest.mark.parametrize("fn,error,match", [
    (lambda l: False, ValueError, "matched no layer"),
    (lambda l: "yes", TypeError, "must return a bool"),
    (lambda m: [], ValueError, "non-empty list"),
    ("blocks", TypeError, "predicate layer -> bool"),
])
def test_recompute_layers_bad_segment_func(fn, error, match):
    with pytest.raises(error, match=match):
        recompute_layers(tiny(), segment_func=fn)
