"""Data and tensor parallelism inside the pipeline stages of a model without embed()/head() (a PaddleFormers
Llama split at ``model.layers``), in the simulated world: ``ap.parallelize`` with the project's default TP
plan for the model (vocab-parallel embedding on the first stage, vocab-parallel LM head on the last),
two SGD steps equal to one process on one big batch (the loss of every step and every rank's shard of
every parameter). SGD, not Adam: Adam's update does not change when every gradient is scaled alike, so a
missing data-parallel mean would pass under Adam. Later stages recompute the blocks' side inputs (causal
mask, positions, rotary tables) from the micro-batch: checked equal to the model's own."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as ap
from autoparallel.dist_tensor import _local_from_full
from autoparallel.parallel.pipeline import auto_split, runtime
from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="PaddleFormers is not installed")

STEPS, LR, RTOL, ATOL = 2, 0.5, 1e-4, 1e-6


def llama(**overrides):
    return pf.build("llama", **dict(dict(tie_word_embeddings=False, num_hidden_layers=4), **overrides))


def data(step):
    return pf.batch(step, b=4, t=8)


def reference():
    model = llama()
    opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        loss = F.cross_entropy(auto_split.model_output(model(paddle.to_tensor(x))), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: p.numpy() for n, p in model.named_parameters()}


_REF = []


def ref():
    if not _REF:
        _REF.append(reference())
    return _REF[0]


def strategy(dp, tp, schedule="1F1B", vpp=1):
    s = ap.Strategy()
    s.pipeline_parallel.degree = 2
    s.pipeline_parallel.schedule = schedule
    s.pipeline_parallel.vpp_degree = vpp
    s.data_parallel.degree = dp
    s.tensor_parallel.degree = tp
    return s


def train(model, s):
    """(losses, pipe) of STEPS steps through ap.parallelize; call inside ap.simulate."""
    opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
    pipe, opt = ap.parallelize(model, opt, strategy=s)
    losses = []
    for step in range(STEPS):
        losses.append(pipe.train_batch(*data(step)))
        opt.step()
        opt.clear_grad()
    return losses, pipe


def mismatches(pipe, ref_params, atol=ATOL) -> list:
    """Parameters whose shard on some rank differs from the reference's slice for that rank."""
    bad = []
    for name, p in pipe.named_parameters():
        want = paddle.to_tensor(ref_params[name])
        for r, t in p.locals.items():
            if not np.allclose(t.numpy(), _local_from_full(want, p.spec, r).numpy(), rtol=RTOL, atol=atol):
                bad.append(f"{name}@rank{r}")
    return bad


JOBS = [(2, 1, "1F1B", 1), (1, 2, "1F1B", 1), (2, 2, "1F1B", 1), (1, 2, "ZB-H1", 1), (2, 1, "VPP", 2)]


@pytest.mark.parametrize("dp,tp,schedule,vpp", JOBS, ids=lambda v: str(v))
def test_paddleformers_llama_dp_tp_inside_stages_equals_one_process(dp, tp, schedule, vpp):
    ref_losses, ref_params = ref()
    with ap.simulate(world_size=2 * dp * tp):
        losses, pipe = train(llama(), strategy(dp, tp, schedule, vpp))
        bad = mismatches(pipe, ref_params)
        assert set(dict(pipe.named_parameters())) == set(ref_params)
        meshes = {tuple(m.process_ids) for m in pipe.meshes.values()}
        first = dict(pipe.stages[0].named_parameters())
        last = dict(pipe.stages[-1].named_parameters())
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=1e-6)
    assert bad == []
    n = dp * tp
    assert meshes == {tuple(range(n)), tuple(range(n, 2 * n))}          # each stage on its own sub-mesh
    assert "model.embed_tokens.weight" in first and "model.embed_tokens.weight" not in last
    if tp > 1:                                 # the default plan: vocab-parallel embedding and LM head
        assert str(first["model.embed_tokens.weight"].spec.placements) == "(R, S(0))"
        assert str(last["lm_head.weight"].spec.placements) == "(R, S(0))"
        assert str(last["model.layers.3.mlp.down_proj.weight"].spec.placements) == "(R, S(0))"


@pytest.mark.parametrize("name,dp,tp", [("qwen2_moe", 1, 2), ("qwen3_next", 2, 1), ("phi3", 1, 2)])
def test_other_families_inside_stages_equal_one_process(name, dp, tp):
    """A shallow MoE model (2 layers, 4 experts: the block list is the layers, not the longer expert list),
    a hybrid linear/full-attention model, a fused [q | k | v] projection; one SGD step each."""
    def build():
        return pf.build(name, tie_word_embeddings=False)

    model = build()
    assert auto_split.find_blocks(model) == "model.layers"
    x, y = data(0)
    loss = F.cross_entropy(auto_split.model_output(model(paddle.to_tensor(x))), paddle.to_tensor(y))
    loss.backward()
    paddle.optimizer.SGD(LR, parameters=model.parameters()).step()
    ref_params = {n: p.numpy() for n, p in model.named_parameters()}
    with ap.simulate(world_size=2 * dp * tp):
        pipe_model = build()
        opt = paddle.optimizer.SGD(LR, parameters=pipe_model.parameters())
        pipe, opt = ap.parallelize(pipe_model, opt, strategy=strategy(dp, tp))
        got = pipe.train_batch(x, y)
        opt.step()
        bad = mismatches(pipe, ref_params, atol=2e-5)
    assert got == pytest.approx(float(loss), rel=1e-5)
    assert bad == []


def test_later_stages_side_inputs_equal_the_models_own():
    """Stage 1's first block gets the causal mask, position ids and rotary tables the unsplit model gives
    block 2 for the same micro-batch, though stage 1 recomputes them while the embedding lives on stage 0's
    mesh (vocab-parallel)."""
    def capture(model, into):
        block = model.model.layers[2]
        orig = block.forward

        def spy(*args, **kwargs):
            into.append({k: [np.asarray(_full(t)) for t in auto_split._tensors(v)] for k, v in kwargs.items()})
            return orig(*args, **kwargs)
        block.forward = spy

    want, got = [], []
    plain = llama()
    capture(plain, want)
    x, _ = data(0)
    for part in np.split(x, 2):                 # the pipeline's two micro-batches
        plain(paddle.to_tensor(part))
    with ap.simulate(world_size=8):
        model = llama()
        capture(model, got)
        opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
        pipe, opt = ap.parallelize(model, opt, strategy=strategy(2, 2))
        assert pipe.plan.bounds == [(0, 2), (2, 4)]
        pipe.train_batch(*data(0))
    assert len(got) == len(want) == 2 and got[0].keys() == want[0].keys()
    assert {"attention_mask", "position_ids", "position_embeddings"} <= set(want[0])
    for g, w in zip(got, want):
        for k in w:
            assert len(g[k]) == len(w[k]), k
            for a, b in zip(g[k], w[k]):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=k)


def _full(t):
    full = getattr(t, "full", None)
    return (full() if callable(full) else t).numpy()


def test_negative_control_shards_handed_to_the_wrong_data_ranks(monkeypatch):
    """Stage 0's data shard 0 handed to stage 1's data rank 1 (and back) must break the equality."""
    local = runtime._local

    def swapped(t):
        out = local(t)
        return runtime._Shards(out.tensors[::-1]) if isinstance(out, runtime._Shards) else out

    monkeypatch.setattr(runtime, "_local", swapped)
    ref_losses, ref_params = ref()
    with ap.simulate(world_size=4):
        losses, pipe = train(llama(), strategy(2, 1))
        bad = mismatches(pipe, ref_params)
    assert bad and not np.allclose(losses[1:], ref_losses[1:], rtol=RTOL, atol=1e-6)


def test_tied_embedding_across_stage_meshes_stays_refused():
    with ap.simulate(world_size=4), pytest.raises(NotImplementedError, match="model.embed_tokens.weight.*untie"):
        train(llama(tie_word_embeddings=True), strategy(1, 2))


def test_launched_ranks_are_refused(monkeypatch):
    """On launched ranks (not simulated) data / tensor parallelism inside auto-split stages is refused."""
    monkeypatch.setattr(runtime, "_world", lambda: (4, 0))
    monkeypatch.setattr(runtime, "_simulated", lambda: False)
    with pytest.raises(NotImplementedError, match=r"LlamaForCausalLM has no embed\(\)/head\(\).*simulated world "
                                                  r"\(ap.simulate\) only.*data_parallel.degree=2, "
                                                  r"tensor_parallel.degree=1 on 4 ranks"):
        runtime.apply_pp(llama(), strategy(2, 1))


class _LearnedSide(nn.Layer):
    """Blocks take a side input computed from a learned parameter (a position table scaled by ``gain``)."""

    class Block(nn.Layer):
        def __init__(self, d):
            super().__init__()
            self.fc = nn.Linear(d, d)

        def forward(self, x, pos):
            return x + self.fc(x + pos)

    def __init__(self, d=8, layers=2):
        super().__init__()
        self.wte = nn.Embedding(16, d)
        self.gain = self.create_parameter([1], default_initializer=nn.initializer.Constant(1.0))
        self.register_buffer("table", paddle.ones([8, d]))
        self.h = nn.LayerList([self.Block(d) for _ in range(layers)])

    def forward(self, ids):
        x = self.wte(ids)
        pos = self.table[: ids.shape[1]] * self.gain
        for b in self.h:
            x = b(x, pos)
        return x


def test_side_input_from_a_learned_parameter_is_refused():
    """Later stages recompute side inputs without gradient: one computed from ``gain`` would lose its
    gradient there, so the split refuses it (even in one process), naming the parameter."""
    s = ap.Strategy()
    s.pipeline_parallel.degree = 2
    with pytest.raises(NotImplementedError, match=r"_LearnedSide: .*learned parameters \(gain\)"):
        runtime.apply_pp(_LearnedSide(), s)
    model = _LearnedSide()
    model.gain.stop_gradient = True                   # frozen: the same on every stage, accepted
    assert runtime.apply_pp(model, s).plan.pieces.generic
