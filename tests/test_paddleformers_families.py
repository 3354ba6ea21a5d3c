"""The PaddleFormers 1.2 text causal-LM families beyond the first eight (Qwen3-MoE, DeepSeek-V3 with MLA and the
noaux_tc gate, GLM-4-MoE, Qwen3-Next with gated-delta linear attention), unedited, in the simulated 4-rank
world: plain DP and the seed shard function equal one process (``ap.parallelize`` runs in test_paddleformers.py
through ``pf.MOE``); each family's config options under ``parallelize``; the MLA plan and its collectives; every
family of the installed package either runs here or is a named skip. Zero-initialised parameters get random
values (``fill_zeros``), so a bias applied once per rank, or not at all, changes the loss."""
import pathlib
import re

import pytest

from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

from autoparallel.testing import paddleformers_runs as pc  # noqa: E402

import autoparallel as ap  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
NEW = ["qwen3_moe", "deepseek_v3", "glm4_moe", "qwen3_next"]
_REF = {}


def reference(name, **overrides):
    key = (name, repr(sorted(overrides.items())))
    if key not in _REF:
        _REF[key] = pf.reference(name, fill_zeros=True, **overrides)
    return _REF[key]


def run(name, mode, **overrides):
    with ap.simulate(world_size=4):
        if mode == "parallelize":
            return pc.parallelize_grads(name, fill_zeros=True, **overrides)
        return pf.sharded(name, mode, fill_zeros=True, **overrides)


@pytest.mark.parametrize("mode", ["dp", "tp"])
@pytest.mark.parametrize("name", NEW)
def test_new_family_equals_one_process(name, mode):
    ref = reference(name)
    got = run(name, mode)
    assert set(got[1]) == set(ref[1])
    assert pf.compare(ref, got, RTOL, ATOL) == [], f"{name} {mode}: worst rel {pc.worst_rel(ref[1], got[1]):.2e}"


@pytest.mark.parametrize("name,option", [(n, o) for n in pf.MODELS for o in pf.VARIANTS.get(n, [])[:1]],
                         ids=lambda v: v if isinstance(v, str) else ",".join(v))
def test_config_option_under_parallelize(name, option):
    """Attention/MLP biases, untied heads, sliding windows, q without a low rank, qk norms: parallelize
    equals one process with the option on, and the option changes the model (a negative check on the option)."""
    ref = reference(name, **option)
    base = reference(name)
    assert len(ref[1]) != len(base[1]) or abs(ref[0] - base[0]) > 1e-6, f"{option} does not change {name}"
    assert pf.compare(ref, run(name, "parallelize", **option), RTOL, ATOL) == []


def test_negative_control_unreduced_gradients_differ():
    with ap.simulate(world_size=4):
        got = pf.sharded("deepseek_v3", "dp", fill_zeros=True, reduce_grads=False)
    bad = pf.compare(reference("deepseek_v3"), got, RTOL, ATOL)
    assert "model.layers.1.self_attn.q_b_proj.weight" in bad and "loss" not in bad


def test_mla_plan_splits_heads_and_adds_no_collective_over_llama():
    """DeepSeek-V3 under parallelize: the per-head up-projections column-parallel, the low-rank
    down-projections replicated, shared experts Megatron-sharded, routed experts replicated; the forward runs
    Llama's TP collectives (no all_gather: the rope key shared by all heads is sliced locally, the first KV
    cache update stays split)."""
    place, counts = _forward_tp_counts("deepseek_v3")
    _, llama = _forward_tp_counts("llama")
    attn = "model.layers.1.self_attn."
    assert place[attn + "q_b_proj.weight"] == place[attn + "kv_b_proj.weight"] == "[R, S(1)]"
    assert place[attn + "q_a_proj.weight"] == place[attn + "kv_a_proj_with_mqa.weight"] == "[R, R]"
    assert place[attn + "o_proj.weight"] == "[R, S(0)]"
    assert place["model.layers.1.mlp.shared_experts.down_proj.weight"] == "[R, S(0)]"
    assert place["model.layers.1.mlp.experts.0.up_proj.weight"] == "[R, R]"
    assert counts == llama and counts.get("all_gather", 0) == 0, (counts, llama)


def _forward_tp_counts(name):
    """({parameter: placements}, {collective: calls on the two TP groups}) of one forward under parallelize."""
    import paddle
    from autoparallel.comm.counter import count_collectives

    with ap.simulate(world_size=4):
        model, _ = pc.parallelized(name)
        ids, labels = pf.batch(0)
        with count_collectives() as calls:
            pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
    tp = {}
    for (k, g), n in calls.per_group().items():
        if g in {(0, 1), (2, 3)}:
            tp[k] = tp.get(k, 0) + n
    return {n: str(p.placements) for n, p in model.named_parameters()}, tp


def _causal_lm_families() -> set:
    """Family dirs of the installed PaddleFormers whose modeling defines a (non-pipeline) text *ForCausalLM."""
    import paddleformers.transformers as t

    out = set()
    for mod in pathlib.Path(t.__file__).parent.glob("*/modeling*.py"):
        if mod.parent.name != "auto" and re.search(r"^class \w+ForCausalLM(Deprecated)?\(", mod.read_text(),
                                                   re.M):
            out.add(mod.parent.name)
    return out


def test_every_causal_lm_family_runs_or_is_a_named_skip():
    covered = {sub for sub, *_ in pf.MODELS.values()} | set(pf.SKIPPED)
    assert _causal_lm_families() - covered == set()
    assert {"deepseek_v3", "qwen3_next", "deepseek_v32", "kimi_k2"} <= covered


def test_the_models_own_recompute_runs_on_distributed_activations(name="llama"):
    """``config.recompute=True`` (full, uniform, one layer per unit): the model calls paddle's reentrant
    recompute on every decoder layer and on its loss. On distributed activations it runs paddle's non-reentrant
    recompute: gradients equal one process, and every layer's forward runs twice (the recompute happened, it
    was not skipped). (Of the other PaddleFormers 1.2 families, most fail this option in one process already --
    their reentrant recompute breaks a broadcast in backward -- and ERNIE 4.5's config drops it.)"""
    import paddle

    option = {"recompute": True, "recompute_granularity": "full", "recompute_method": "uniform",
              "recompute_num_layers": 1}
    ref = reference(name, **option)
    with ap.simulate(world_size=4):
        model, opt = pc.parallelized(name, fill_zeros=True, **option)
        calls = []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *a: calls.append(1))
        ids, labels = pf.batch(0)
        loss = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
        assert len(calls) == pf.LAYERS
        loss.backward()
        assert len(calls) == 2 * pf.LAYERS
        opt.reduce_gradients()
        got = float(loss), {n: pf._grad_np(p) for n, p in model.named_parameters()}
    assert pf.compare(ref, got, RTOL, ATOL) == []
