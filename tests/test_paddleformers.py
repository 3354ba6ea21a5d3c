"""PaddleFormers 1.2 causal LMs, unedited, in the simulated 4-rank world on a 2x2 ["data", "model"] mesh:
plain DP, the seed's shard function and ``ap.parallelize`` (dp=2, tp=2, default plans) each equal one
process (loss and every gradient); ties kept; every parameter in the optimizer once; a split tie caught
(negative control); GQA with fewer kv heads than TP ranks; bad plans on a real model as typed errors."""

import numpy as np
import pytest

from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

from autoparallel.testing import paddleformers_runs as pc

import autoparallel as ap  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
_REF = {}


def reference(name, **overrides):
    key = (name, tuple(sorted(overrides.items())))
    if key not in _REF:
        _REF[key] = pf.reference(name, **overrides)
    return _REF[key]


def run(name, mode, **overrides):
    with ap.simulate(world_size=4):
        if mode == "parallelize":
            return pc.parallelize_grads(name, **overrides)
        return pf.sharded(name, mode, **overrides)


@pytest.mark.parametrize("mode", ["dp", "tp", "parallelize"])
@pytest.mark.parametrize("name", pf.DENSE)
def test_dense_model_equals_one_process(name, mode):
    ref = reference(name)
    got = run(name, mode)
    assert set(got[1]) == set(ref[1])
    assert pf.compare(ref, got, RTOL, ATOL) == [], f"{name} {mode}: worst rel {pc.worst_rel(ref[1], got[1]):.2e}"


def test_negative_control_a_split_tie_is_caught():
    """Untie Llama's head from its embedding (a copy, as a split tie would leave it): the embedding's
    gradient loses the head's term and the comparison fails."""
    ref = reference("llama")
    with ap.simulate(world_size=4):
        untied = _untied_llama_grads()
    assert "model.embed_tokens.weight" in pf.compare(ref, untied, RTOL, ATOL)


def _untied_llama_grads():
    """Llama with the head holding a copy of the embedding: the run a split tie amounts to."""
    import paddle

    model, opt = _split_tie_model()
    ids, labels = pf.batch(0)
    loss = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
    loss.backward()
    opt.reduce_gradients()
    grads = {n: pf._grad_np(p) for n, p in model.named_parameters()}
    return float(loss), {n: g for n, g in grads.items() if n != "lm_head.weight"}


def _split_tie_model():
    import paddle

    model = pf.build("llama")
    copy = paddle.create_parameter(model.lm_head.weight.shape, "float32")
    copy.set_value(model.lm_head.weight.numpy())
    model.lm_head.weight = copy
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    return ap.parallelize(model, opt, strategy=pc.strategy())


def test_tied_head_is_vocab_parallel_and_one_parameter():
    with ap.simulate(world_size=4):
        model, opt = pc.parallelized("llama")
    head, emb = model.lm_head.weight, model.model.embed_tokens.weight
    assert head is emb and str(head.placements) == "[R, S(0)]" and head.global_shape == [pf.VOCAB, pf.HIDDEN]
    assert str(model.model.layers[0].self_attn.o_proj.weight.placements) == "[R, S(0)]"
    assert str(model.model.layers[0].mlp.up_proj.weight.placements) == "[R, S(1)]"


def test_shard_layer_keeps_a_real_models_tie():
    with ap.simulate(world_size=4):
        model = ap.shard_layer(pf.build("ernie4_5"), pf.mesh_2x2(), pf.seed_shard_fn)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert str(model.model.layers[1].self_attn.qkv_proj.weight.placements) == "[R, S(1)]"


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_fewer_kv_heads_than_tp_ranks(name):
    """num_key_value_heads=1 < tp=2: separate k/v projections stay replicated, a fused qkv gathers its output."""
    ref = reference(name, num_key_value_heads=1)
    got = run(name, "parallelize", num_key_value_heads=1)
    assert pf.compare(ref, got, RTOL, ATOL) == []
    with ap.simulate(world_size=4):
        model, _ = pc.parallelized(name, num_key_value_heads=1)
    attn = model.model.layers[0].self_attn
    if name == "llama":
        assert str(attn.k_proj.weight.placements) == "[R, R]" and str(attn.q_proj.weight.placements) == "[R, S(1)]"
    else:
        assert str(attn.qkv_proj.weight.placements) == "[R, S(1)]"


def test_a_plan_naming_missing_layers_is_a_typed_error():
    from autoparallel.parallel.tensor_parallel import PlanError

    with ap.simulate(world_size=4), pytest.raises(PlanError, match=r"pattern 'mlp\.gate_up_proj' matches no layer of "
                                                                   r"LlamaForCausalLM; its leaf layers: model\.embed_tokens, "
                                                                   r"model\.layers\.\*\.self_attn\.q_proj.*; layers ending "
                                                                   r"in 'gate_proj', 'up_proj', 'v_proj' exist"):
        pc.parallelized("llama", tp_plan={"mlp.gate_up_proj": ap.ColWiseParallel()})


def test_a_tie_that_cannot_be_honoured_is_a_typed_error():
    """Row-parallel on the tied [vocab, hidden] head splits hidden, the embedding splits vocab: one parameter
    cannot have both layouts."""
    from autoparallel.parallel.ties import TiedLayoutError

    with ap.simulate(world_size=4), pytest.raises(TiedLayoutError, match=r"model\.embed_tokens\.weight.*"
                                                                         r"lm_head\.weight.*one layout"):
        pc.parallelized("llama", tp_plan={"lm_head": ap.RowWiseParallel()})


@pytest.mark.parametrize("name", pf.MOE)
def test_moe_under_parallelize_shards_dense_layers_and_replicates_experts(name):
    ref = reference(name)
    got = run(name, "parallelize")
    assert pf.compare(ref, got, RTOL, ATOL) == []
    with ap.simulate(world_size=4):
        model, _ = pc.parallelized(name)
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    routing = [n for n in placements if ".experts." in n or ".mlp.gate." in n or ".router." in n]
    assert routing and all(placements[n] == "[R, R]" for n in routing), routing
    o_proj = [n for n in placements if n.endswith("self_attn.o_proj.weight")]   # Qwen3-Next: layer 1 only
    assert o_proj and all(placements[n] == "[R, S(0)]" for n in o_proj)
    if name == "qwen2_moe":
        assert placements["model.layers.0.mlp.shared_expert.down_proj.weight"] == "[R, S(0)]"


@pytest.mark.parametrize("name", ["llama", "qwen3", "phi3", "deepseek_v3"])
def test_sequence_parallel_on_real_models(name):
    """Row-parallel outputs as sequence shards, every norm (Qwen3's per-head q/k norms too) on them."""
    ref = reference(name)
    with ap.simulate(world_size=4):
        got = pc.parallelize_grads(name, sp=True)
    assert pf.compare(ref, got, RTOL, ATOL) == []


def test_tp_that_does_not_divide_the_heads_is_refused_before_any_work():
    with ap.simulate(world_size=3), pytest.raises(ValueError, match=r"tensor_parallel.degree=3 must divide.*heads"):
        ap.parallelize(pf.build("llama"), strategy=pc.strategy(dp=1, tp=3))


def test_lazy_built_tied_model_equals_one_process():
    """Built under paddle.LazyGuard: the tied embedding/head is drawn once, the values equal the eager build."""
    import paddle

    ref = reference("llama")
    cls, _, _ = pf.model_class("llama")
    with ap.simulate(world_size=4):
        paddle.seed(0)
        with paddle.LazyGuard():
            model = cls(pf.config("llama"))
        opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=pc.strategy())
        ids, labels = pf.batch(0)
        loss = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
        loss.backward()
        opt.reduce_gradients()
        got = float(loss), {n: pf._grad_np(p) for n, p in model.named_parameters()}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert pf.compare(ref, got, RTOL, ATOL) == []
