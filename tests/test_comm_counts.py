"""Simulated world: where gradients are reduced. A replicated tensor read by several tensor-parallel consumers
is reduced once; a parameter read through a cast is reduced in the data-parallel buckets, not one by one in
backward; a parameter with both split and replicated uses gets the right gradient whichever use comes first.
Counts are taken on the simulated transport (one call per group), values against one process."""
import collections
import contextlib

import numpy as np
import paddle
import pytest

from autoparallel import layer_state
import autoparallel as ap
from autoparallel.comm import fanout
from autoparallel.comm.counter import count_collectives
from autoparallel.testing import paddleformers_models as pf


@contextlib.contextmanager
def counted():
    """{(kind, group): calls} of the simulated transport."""
    log = collections.Counter()
    with count_collectives() as calls:
        yield log
    log.update(calls.per_group())


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
    from autoparallel.testing import paddleformers_runs as pc

    with ap.simulate(world_size=4):
        model, opt = pc.parallelized(name, **kw)
        ids, labels = pf.batch(0)
        loss = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
        with counted() as log:
            loss.backward()
        opt.reduce_gradients()
        got = (float(loss), {n: pf._grad_np(p) for n, p in model.named_parameters()})
        buckets = collections.Counter(tuple(("data", "model")[d] for d in b.dims) for b in opt.grad_sync.buckets)
    return log, got, buckets


def _bucket_reductions(buckets, dim) -> int:
    """All_reduces per group of mesh dim ``dim`` the buckets launch (a bucket over both dims: one per dim)."""
    return sum(n for dims, n in buckets.items() if dim in dims)


def _on(log, kind, groups):
    return sum(n for (k, g), n in log.items() if k == kind and g in groups)


TP_GROUPS, DP_GROUPS = {(0, 1), (2, 3)}, {(0, 2), (1, 3)}


@needs_pf
def test_norm_weights_read_through_a_cast_are_not_reduced_one_by_one():
    """Gemma3's norms compute ``x * (1.0 + weight.float())``: backward's data-parallel all_reduces are the
    buckets' (the weights join them; none is reduced on its own) and the tensor-parallel ones are Megatron's 2
    per layer + the head's (+ the buckets' over the model dim)."""
    ref = pf.reference("gemma3")
    log, got, buckets = _backward_counts("gemma3")
    # the first backward reduces from the buckets' hooks: one all_reduce per bucket and group, none per norm
    assert 0 < sum(buckets.values()) < 2 * pf.LAYERS, buckets
    assert _on(log, "all_reduce", DP_GROUPS) == 2 * _bucket_reductions(buckets, "data"), (log, buckets)
    assert _on(log, "all_reduce", TP_GROUPS) == 2 * (2 * pf.LAYERS + 1 + _bucket_reductions(buckets, "model")), log
    assert pf.compare(ref, got) == []


@needs_pf
def test_llama_backward_reduces_each_shared_input_once_and_per_use_is_the_baseline():
    ref = pf.reference("llama")
    log, got, _ = _backward_counts("llama")
    assert _on(log, "all_reduce", TP_GROUPS) == 2 * (2 * pf.LAYERS + 1), log     # per group: 2/layer + head
    assert pf.compare(ref, got) == []
    with fanout.disabled():
        base, got, _ = _backward_counts("llama")
    assert _on(base, "all_reduce", TP_GROUPS) == 2 * (5 * pf.LAYERS + 1), base  # q, k, v, gate, up each
    assert pf.compare(ref, got) == []


@needs_pf
def test_sequence_parallel_backward_is_reduce_scatter_not_all_reduce():
    ref = pf.reference("llama")
    log, got, buckets = _backward_counts("llama", sp=True)
    # the norm weights' gradients, partial over the sequence shards, are reduced over "model" in buckets only
    assert _on(log, "all_reduce", TP_GROUPS) == 2 * _bucket_reductions(buckets, "model") <= 2 * 2, (log, buckets)
    assert _on(log, "reduce_scatter", TP_GROUPS) == 2 * (2 * pf.LAYERS + 1), log
    assert pf.compare(ref, got) == []


def _counts_each_way(name, tp_plan=None):
    """TP-group collective counts of one forward and one backward under parallelize (dp2 x tp2), and the
    loss and gradients."""
    from autoparallel.testing import paddleformers_runs as pc

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


# ---- the project's models: Megatron's pattern counted in the simulated world, as on real ranks -----------------
# tests/test_comm_counts_dist.py counts the same calls with the same counter on 4 gloo ranks
TP_LAYER, SP_LAYER = {"all_reduce": 2}, {"all_gather": 2, "reduce_scatter": 2}
BATCH, SEQ = 4, 8


def _project_step(preset, layers, sp):
    """One forward + backward of the project's model under parallelize (dp=2, tp=2) in a simulated world
    of 4: the transport's collectives forward and backward, and the tensor-parallel groups."""
    import dataclasses

    from examples.models import PRESETS, build

    paddle.seed(0)
    cfg = dataclasses.replace(PRESETS[preset], layers=layers)
    model = build(cfg)
    loss_of = type(model).loss
    rng = np.random.default_rng(0)
    ids, labels = (paddle.to_tensor(rng.integers(0, cfg.vocab_size, (BATCH, SEQ)).astype("int64")) for _ in "ab")
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    strategy = ap.Strategy()
    strategy.data_parallel.degree = strategy.tensor_parallel.degree = 2
    strategy.sequence_parallel.enable = sp
    with ap.simulate(world_size=4):
        model, opt = ap.parallelize(model, opt, strategy=strategy)
        with count_collectives() as fwd:
            loss = loss_of(model(ids), labels)
        with count_collectives() as bwd:
            loss.backward()
    tp_groups = {tuple(sorted(g)) for g in layer_state.mesh_of(model).all_groups("model")}
    return {"fwd": fwd, "bwd": bwd}, tp_groups, cfg


def _per_layer(preset, sp):
    """{phase: {rank: {kind: calls}}} one decoder layer adds on the rank's TP group (2 layers minus 1), and the
    bytes it adds per rank."""
    (one, groups, _), (two, _, cfg) = _project_step(preset, 1, sp), _project_step(preset, 2, sp)
    counts, sent = {}, {}
    for ph in ("fwd", "bwd"):
        counts[ph] = {r: _sub(two[ph].counts(r, groups), one[ph].counts(r, groups)) for r in range(4)}
        sent[ph] = {r: two[ph].bytes_sent(r, groups) - one[ph].bytes_sent(r, groups) for r in range(4)}
    return counts, sent, cfg


def _sub(a, b):
    return {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b) if a.get(k, 0) != b.get(k, 0)}


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_simulated_tensor_parallel_layer_is_two_all_reduces_each_way(preset):
    counts, sent, cfg = _per_layer(preset, sp=False)
    act = BATCH // 2 * SEQ * cfg.hidden * 4                  # one rank's [b/dp, s, h] float32 activation
    for ph in ("fwd", "bwd"):
        assert counts[ph] == {r: TP_LAYER for r in range(4)}, (ph, counts[ph])
        # a ring all_reduce over 2 ranks sends 2 (n-1)/n b = b per call
        assert sent[ph] == {r: 2 * act for r in range(4)}, (ph, sent[ph])


def test_simulated_sequence_parallel_layer_is_two_gathers_and_two_reduce_scatters_each_way():
    counts, _, _ = _per_layer("gpt-tiny", sp=True)
    for ph in ("fwd", "bwd"):
        assert counts[ph] == {r: SP_LAYER for r in range(4)}, (ph, counts[ph])


def test_counter_sees_one_call_per_group_in_the_simulated_world_and_each_rank_its_own():
    """Per group: one call; rank r's view: the calls of the groups r belongs to (what r counts on a real job);
    negative control: a group r is not in is not in r's view."""
    phases, groups, _ = _project_step("gpt-tiny", 1, False)
    log = phases["fwd"]
    per_group = log.per_group()
    assert {g for (_, g) in per_group} >= groups
    for r in range(4):
        mine = [c for c in log.calls if r in c.group]
        assert len(log.seen_by(r)) == len(mine) and len(mine) < len(log.calls)
        (tp,) = [g for g in groups if r in g]
        other = next(g for g in groups if r not in g)
        assert log.counts(r, [tp]) == log.counts(None, [tp]) and log.counts(r, [other]) == {}


def test_negative_control_simulated_per_use_reduction_is_one_per_consumer():
    """With the shared reduction disabled, LLaMA's q, k, v, gate and up each reduce their own partial input
    gradient: 5 all_reduces per layer backward, which the counter sees."""
    with fanout.disabled():
        counts, _, _ = _per_layer("llama-tiny", sp=False)
    assert counts["fwd"] == {r: TP_LAYER for r in range(4)}
    assert counts["bwd"] == {r: {"all_reduce": 5} for r in range(4)}, counts["bwd"]
