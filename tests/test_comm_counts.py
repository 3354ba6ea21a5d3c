"""Simulated world: where gradients are reduced. A replicated tensor read by several tensor-parallel consumers
is reduced once; a parameter read through a cast is reduced in the data-parallel buckets, not one by one in
backward; a parameter with both split and replicated uses gets the right gradient whichever use comes first.
Counts are taken on the simulated transport (one call per group), values against one process."""
import collections
import contextlib
import os
import sys

import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.comm import fanout, transport
from autoparallel.testing import paddleformers_models as pf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist_scripts"))


@contextlib.contextmanager
def counted():
    """{(kind, group): calls} of the simulated transport."""
    log = collections.Counter()
    saved = {k: getattr(transport.SimTransport, k) for k in ("all_gather", "all_reduce", "reduce_scatter")}

    def wrap(kind, fn):
        def run(self, xs, ranks, *a, **k):
            log[(kind, tuple(ranks))] += 1
            return fn(self, xs, ranks, *a, **k)
        return run

    for k, fn in saved.items():
        setattr(transport.SimTransport, k, wrap(k, fn))
    try:
        yield log
    finally:
        for k, fn in saved.items():
            setattr(transport.SimTransport, k, fn)


def _mixed(dist: bool, cast: bool, replicated_first: bool):
    """A Linear whose weight is also read by a replicated term of the loss (weight decay written by hand)."""
    paddle.seed(0)
    lin = paddle.nn.Linear(4, 3)
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((4, 4)).astype("float32"))
    if dist:
        mesh = ap.ProcessMesh([0, 1], dim_names=["data"])
        lin = ap.shard_layer(lin, mesh, None)
        x = ap.shard_tensor(x, mesh, [ap.Shard(0)])
    w = lin.weight.astype("float32") if cast else lin.weight
    terms = [lambda: (w ** 2).sum(), lambda: lin(x).mean()]
    a, b = terms if replicated_first else terms[::-1]
    (a() + b()).backward()
    if dist:
        ap.reduce_gradients(lin.parameters())
        return lin.weight.as_dist().grad.full().numpy()
    return lin.weight.grad.numpy()


@pytest.mark.parametrize("cast", [False, True])
@pytest.mark.parametrize("replicated_first", [False, True])
def test_split_and_replicated_uses_of_one_weight_equal_one_process(cast, replicated_first):
    ref = _mixed(False, cast, replicated_first)
    with ap.simulate(world_size=2):
        got = _mixed(True, cast, replicated_first)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


needs_pf = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")


def _backward_counts(name, **kw):
    import paddleformers_common as pc

    with ap.simulate(world_size=4):
        model, opt = pc.parallelized(name, **kw)
        ids, labels = pf.batch(0)
        loss = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
        with counted() as log:
            loss.backward()
        opt.reduce_gradients()
        got = (float(loss), {n: pf._grad_np(p) for n, p in model.named_parameters()})
    return log, got


def _on(log, kind, groups):
    return sum(n for (k, g), n in log.items() if k == kind and g in groups)


TP_GROUPS, DP_GROUPS = {(0, 1), (2, 3)}, {(0, 2), (1, 3)}


@needs_pf
def test_norm_weights_read_through_a_cast_are_not_reduced_one_by_one():
    """Gemma3's norms compute ``x * (1.0 + weight.float())``: backward runs no data-parallel all_reduce
    (the weights join the buckets) and the tensor-parallel ones are Megatron's 2 per layer + the head's."""
    ref = pf.reference("gemma3")
    log, got = _backward_counts("gemma3")
    assert _on(log, "all_reduce", DP_GROUPS) == 0, log
    assert _on(log, "all_reduce", TP_GROUPS) == 2 * (2 * pf.LAYERS + 1), log
    assert pf.compare(ref, got) == []


@needs_pf
def test_llama_backward_reduces_each_shared_input_once_and_per_use_is_the_baseline():
    ref = pf.reference("llama")
    log, got = _backward_counts("llama")
    assert _on(log, "all_reduce", TP_GROUPS) == 2 * (2 * pf.LAYERS + 1), log     # per group: 2/layer + head
    assert pf.compare(ref, got) == []
    with fanout.disabled():
        base, got = _backward_counts("llama")
    assert _on(base, "all_reduce", TP_GROUPS) == 2 * (5 * pf.LAYERS + 1), base  # q, k, v, gate, up each
    assert pf.compare(ref, got) == []


@needs_pf
def test_sequence_parallel_backward_is_reduce_scatter_not_all_reduce():
    ref = pf.reference("llama")
    log, got = _backward_counts("llama", sp=True)
    assert _on(log, "all_reduce", TP_GROUPS) == 0, log
    assert _on(log, "reduce_scatter", TP_GROUPS) == 2 * (2 * pf.LAYERS + 1), log
    assert pf.compare(ref, got) == []


def _counts_each_way(name, tp_plan=None):
    """TP-group collective counts of one forward and one backward under parallelize (dp2 x tp2), and the
    loss and gradients."""
    import paddleformers_common as pc

    with ap.simulate(world_size=4):
        model, opt = pc.parallelized(name, tp_plan=tp_plan)
        ids, labels = pf.batch(0)
        with counted() as fwd:
            loss = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
        with counted() as bwd:
            loss.backward()
        opt.reduce_gradients()
        got = (float(loss), {n: pf._grad_np(p) for n, p in model.named_parameters()})
    kinds = ("all_gather", "all_reduce", "reduce_scatter")
    return tuple({k: _on(log, k, TP_GROUPS) for k in kinds} for log in (fwd, bwd)), got


@needs_pf
@pytest.mark.parametrize("name", ["phi3", "qwen2_moe"])
def test_fused_projections_add_no_collective(name):
    """Phi3's [gate | up] and [q | k | v] and Qwen2-MoE's shared-expert [gate | up] are block-sharded: the
    counts equal Llama's separate projections (Megatron's), no all_gather either way, values as one process."""
    llama, _ = _counts_each_way("llama")
    counts, got = _counts_each_way(name)
    assert counts == llama, (counts, llama)
    assert counts[0]["all_gather"] == counts[1]["all_gather"] == 0
    assert pf.compare(pf.reference(name), got) == []


@needs_pf
def test_negative_control_gathered_fused_outputs_add_all_gathers():
    gather = ap.ColWiseParallel(gather_output=True)
    counts, got = _counts_each_way("phi3", tp_plan={"qkv_proj": gather, "gate_up_proj": gather})
    assert counts[0]["all_gather"] == 2 * 2 * pf.LAYERS, counts        # per TP group: qkv and gate_up per layer
    assert pf.compare(pf.reference("phi3"), got) == []
