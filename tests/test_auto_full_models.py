"""auto_mode="full" on the PaddleFormers families, unedited, in the simulated 4-rank world: the planner reads each
model (the trace for dense models, the config for mixtures of experts, whose routing the spec-only trace cannot
follow), chooses degrees the model's plans accept, and parallelize's run equals one process (loss and every
gradient; two AdamW steps for one dense and one MoE family). Zero-initialised parameters get random values
(``fill_zeros``) so a bias applied once per rank, or not at all, changes the loss."""
import contextlib

import numpy as np
import pytest

from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import paddle  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel.planner.auto import choose  # noqa: E402
from autoparallel.planner.from_trace import counted_params  # noqa: E402
from autoparallel.planner.model_read import read_model, tp_refusal  # noqa: E402
from autoparallel.testing.negative import no_gradient_reduction  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
B, T = 4, 8


def full_strategy(global_batch):
    s = ap.Strategy()
    s.auto_mode = "full"
    s.global_batch_size = global_batch
    return s


_REF = {}


def reference(name, steps=0):
    """One process: (loss, {name: gradient}) after one backward, or (losses, {name: parameter}) after steps
    (computed once per arguments: the callers only read it)."""
    if (name, steps) not in _REF:
        model = pf.build(name, fill_zeros=True)
        opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
        _REF[name, steps] = _run(model, opt, steps, reduce=False)
    return _REF[name, steps]


def _run(model, opt, steps, reduce=True):
    ids, labels = (paddle.to_tensor(a) for a in pf.batch(0, B, T))
    if not steps:
        loss = pf.loss_of(model(input_ids=ids, labels=labels))
        with contextlib.nullcontext() if reduce else no_gradient_reduction():
            loss.backward()
        if reduce:
            opt.reduce_gradients()
        return float(loss), {n: pf._grad_np(p) for n, p in model.named_parameters()}
    losses = []
    for _ in range(steps):
        loss = pf.loss_of(model(input_ids=ids, labels=labels))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: (p.full().numpy() if hasattr(p, "full") else p.numpy()) for n, p in model.named_parameters()}


def full(name, global_batch, steps=0, reduce=True, capsys=None):
    """(chosen Strategy, PlanResult, result of _run) under auto_mode="full" on 4 simulated ranks."""
    with ap.simulate(world_size=4):
        model = pf.build(name, fill_zeros=True)
        opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=full_strategy(global_batch), seq_len=T)
        chosen, plan = ap.chosen_strategy(model), ap.chosen_plan(model)
        return chosen, plan, _run(model, opt, steps, reduce)


@pytest.mark.parametrize("global_batch", [2, 4])
@pytest.mark.parametrize("name", list(pf.MODELS))
def test_full_mode_equals_one_process(name, global_batch, capsys):
    """Global batch 2 leaves dp <= 2, so the planner takes tp=2 (the family's plan applied); 4 gives dp=4."""
    chosen, plan, got = full(name, global_batch)
    assert "auto_mode='full': planned for 4 ranks" in capsys.readouterr().out
    tp, dp = chosen.tensor_parallel.degree, chosen.data_parallel.degree
    assert dp * tp * chosen.pipeline_parallel.degree == 4 and global_batch % dp == 0
    assert tp == 4 // global_batch                     # on the CPU profile: as much dp as the batch allows
    model = pf.build(name)
    assert tp_refusal(model, tp) is None and model.config.num_attention_heads % tp == 0
    assert pf.compare(reference(name), got, RTOL, ATOL) == []


def test_negative_control_unreduced_gradients_differ():
    """The same comparison fails when the data-parallel gradient reduction is skipped."""
    chosen, _, got = full("qwen2_moe", 4, reduce=False)
    assert chosen.data_parallel.degree == 4
    bad = pf.compare(reference("qwen2_moe"), got, RTOL, ATOL)
    assert "loss" not in bad and "model.layers.0.self_attn.qkv_proj.weight" in bad


@pytest.mark.parametrize("name", ["llama", "qwen2_moe"])
def test_adamw_steps_equal_one_process(name):
    losses, params = reference(name, steps=2)               # the second step reads the first's AdamW moments
    _, _, (got_losses, got_params) = full(name, 2, steps=2)
    np.testing.assert_allclose(got_losses, losses, rtol=RTOL, atol=ATOL)
    assert losses[-1] < losses[0]
    for n, p in params.items():
        np.testing.assert_allclose(got_params[n], p, rtol=RTOL, atol=ATOL, err_msg=n)


def test_reading_dense_is_traced_and_moe_from_config():
    dense = read_model(pf.build("qwen3"), T, "qwen3")
    assert dense.source.startswith("traced") and not dense.is_moe and dense.traced is not None
    assert (dense.hidden, dense.heads, dense.kv_heads, dense.ffn, dense.swiglu) == (64, 4, 2, 128, True)
    assert not dense.tied_embeddings                    # PaddleFormers' [vocab, hidden] LMHead is a head
    ernie = read_model(pf.build("ernie4_5"), T, "ernie")  # head_dim 128 x 4 heads != hidden 64
    assert ernie.attn_dim == 512 and ernie.head_dim == 128
    moe = read_model(pf.build("qwen2_moe"), T, "qwen2_moe")
    assert "read from model.config" in moe.source and "estimated" in moe.source and "'where'" in moe.source
    assert (moe.experts, moe.top_k, moe.expert_ffn, moe.shared_experts, moe.dense_layers) == (4, 2, 32, 2, 0)
    assert moe.ops.layer_ops > 100 and "ran eagerly on a random sample" in moe.source   # experts' ops counted
    ds = read_model(pf.build("deepseek_v3"), T, "deepseek_v3")
    assert (ds.experts, ds.shared_experts, ds.dense_layers) == (4, 1, 1)
    for name in pf.MODELS:                              # the real parameter count, whichever way it was read
        model = pf.build(name)
        assert read_model(model, T, name).params == counted_params(model), name


def test_explanation_says_what_was_read(capsys):
    _, plan, _ = full("gpt_oss", 4)
    text = str(plan)
    assert "read from model.config" in text and "num_experts=4, num_experts_per_tok=2" in text
    assert "estimated: the per-token cost of the MoE blocks" in text
    _, plan, _ = full("llama", 4)
    assert "traced: forward ops, FLOPs" in str(plan)


def test_degree_the_model_cannot_take_is_refused():
    """6 heads: tp=4 is refused (the plans split whole heads); with global batch 1 (dp=1) nothing else fits
    4 ranks, so the planner raises instead of picking it; with 2 it takes tp=2."""
    model = pf.build("llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=6, head_dim=8)
    assert "heads=6" in tp_refusal(model, 4) and tp_refusal(model, 2) is None
    with pytest.raises(ValueError, match="no configuration"):
        choose(model, full_strategy(1), 4, seq_len=T)
    chosen, result = choose(model, full_strategy(2), 4, seq_len=T)
    assert chosen.tensor_parallel.degree == 2 and "tp=4 refused: heads=6" in result.explanation
    odd = pf.build("llama", intermediate_size=130, vocab_size=126)   # uneven shards: the plans take them
    assert tp_refusal(odd, 4) is None


def test_model_without_a_plan_takes_no_tensor_parallelism():
    class Custom(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.tok = paddle.nn.Embedding(32, 16)
            self.stack = paddle.nn.LayerList([paddle.nn.Linear(16, 16)])

    assert "no default tensor-parallel plan" in tp_refusal(Custom(), 2)


def test_selective_recompute_only_with_a_findable_attention_core():
    """PaddleFormers' attention has no module-level core function for selective recompute to wrap: on a GPU
    profile (where recompute is priced) the planner never offers it for llama."""
    from autoparallel.planner.auto import _selective_ok

    model = pf.build("llama")
    assert not _selective_ok(model)
    with ap.simulate(world_size=4):
        _, result = choose(model, full_strategy(8), 4, seq_len=T, cluster="1x4:A100-80GB")
    assert result.candidates and all(c.config.recompute != "selective" for c in result.candidates)


def test_what_cannot_be_read_raises():
    with pytest.raises(ValueError, match="global_batch_size"):
        choose(pf.build("llama"), full_strategy(None), 4, seq_len=T)
    model = pf.build("qwen2_moe")
    model.config.num_experts = None                     # the trace stops at routing; the config has no experts
    with pytest.raises(ValueError, match="names no experts"):
        read_model(model, T, "qwen2_moe")


class _Forms(paddle.nn.Layer):
    """Embedding, one block, head; the forward returns its logits in one of the forms users' models return."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.embed = paddle.nn.Embedding(16, 8)
        self.blocks = paddle.nn.LayerList([paddle.nn.Linear(8, 8)])
        self.head = paddle.nn.Linear(8, 16)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.blocks[0](self.embed(input_ids)))
        if self.form == "tuple":
            return (logits,)
        if self.form == "dict":
            return {"logits": logits}
        if self.form == "own loss":                    # the model's loss (x 0.5: one op more than ours)
            return {"loss": paddle.nn.functional.cross_entropy(logits, labels) * 0.5, "logits": logits}
        return "not a tensor"


def test_output_forms_tuple_dict_and_own_loss():
    from autoparallel.planner.from_trace import trace_model

    nodes = {}
    for form in ("tuple", "dict", "own loss"):
        graph, _, _ = trace_model(_Forms(form), 4, 2)
        out = graph.graph["outputs"]
        assert tuple(out.shape) == () and [d["op"] for _, d in graph.nodes(data=True)].count("cross_entropy") == 1
        nodes[form] = graph.number_of_nodes()
    assert nodes["tuple"] == nodes["dict"] == nodes["own loss"] - 1
    with pytest.raises(TypeError, match="expected the logits"):
        trace_model(_Forms("bad"), 4, 2)


def test_moe_reading_keeps_rng_and_buffers_and_lazy_models_use_the_template():
    """The MoE layers' eager sample run leaves the RNG stream as it was; a LazyGuard model cannot run its
    experts, so its op counts are the template and the text says so."""
    model = pf.build("deepseek_v3")
    buffers = [b.numpy().copy() for b in model.buffers()]
    paddle.seed(5)
    expected = paddle.rand([4]).numpy()
    paddle.seed(5)
    read_model(model, T, "deepseek_v3")
    np.testing.assert_array_equal(paddle.rand([4]).numpy(), expected)
    assert all(np.array_equal(b.numpy(), v) for b, v in zip(model.buffers(), buffers))
    with paddle.LazyGuard():
        lazy = pf.build("qwen2_moe")
    spec = read_model(lazy, T, "qwen2_moe")
    assert "op counts: the template" in spec.source and spec.ops is None and spec.experts == 4


def test_ap_plan_reads_a_moe_model_too():
    result = ap.plan(pf.build("glm4_moe"), "1x8:A100-80GB", global_batch_size=16, seq_len=32)
    assert result.candidates and (result.model.experts, result.model.dense_layers) == (4, 1)


@pytest.mark.parametrize("name,option", [(n, pf.VARIANTS[n][0]) for n in pf.MODELS if n in pf.VARIANTS],
                         ids=lambda v: v if isinstance(v, str) else ",".join(v))
def test_config_option_under_full_mode(name, option):
    """Each family's first config option (biases, untied heads, sliding windows, MLA without a q rank...)."""
    ref = pf.reference(name, fill_zeros=True, **option)
    with ap.simulate(world_size=4):
        model = pf.build(name, fill_zeros=True, **option)
        opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=full_strategy(2), seq_len=T)
        assert ap.chosen_strategy(model).tensor_parallel.degree == 2
        ids, labels = (paddle.to_tensor(a) for a in pf.batch(0))
        loss = pf.loss_of(model(input_ids=ids, labels=labels))
        loss.backward()
        opt.reduce_gradients()
        got = float(loss), {n: pf._grad_np(p) for n, p in model.named_parameters()}
    assert pf.compare(ref, got, RTOL, ATOL) == []


def test_uneven_vocabulary_is_taken_under_full_mode():
    """vocab 127 over tp=2 (64 + 63 rows, ceil-division): the planner does not refuse it and the run equals one
    process."""
    def run(model, opt, dist):
        ids, labels = (paddle.to_tensor(a) for a in pf.batch(0, B, T, vocab=127))
        loss = pf.loss_of(model(input_ids=ids, labels=labels))
        loss.backward()
        if dist:
            opt.reduce_gradients()
        return float(loss), {n: pf._grad_np(p) for n, p in model.named_parameters()}

    model = pf.build("llama", vocab_size=127)
    ref = run(model, None, False)
    with ap.simulate(world_size=4):
        model = pf.build("llama", vocab_size=127)
        opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=full_strategy(2), seq_len=T)
        assert ap.chosen_strategy(model).tensor_parallel.degree == 2
        got = run(model, opt, True)
    assert pf.compare(ref, got, RTOL, ATOL) == []
