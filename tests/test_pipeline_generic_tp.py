"""Data and tensor parallelism inside the pipeline stages of a model without embed()/head() (a PaddleFormers
Llama split at ``model.layers``), in the simulated world: ``ap.parallelize`` with the project's default TP
plan for the model (vocab-parallel embedding on the first stage, vocab-parallel LM head on the last),
two SGD steps equal to one process on one big batch (the loss of every step and every rank's shard of
every parameter). SGD, not Adam: Adam's update does not change when every gradient is scaled alike, so a
missing data-parallel mean would pass under Adam. Later stages recompute the blocks' side inputs (causal
mask, positions, rotary tables) from the micro-batch: checked equal to the model's own. One 4-rank gloo launch
runs the same on real ranks (PP2 x DP2, PP2 x TP2 under ZB-H1, PP2 x TP2 and PP2 x DP2 (also under ZeRO-2) with tied
embeddings)."""

import json
import os

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as ap
from autoparallel.dist_tensor import _local_from_full
from autoparallel.parallel.pipeline import auto_split, runtime
from autoparallel.testing import paddleformers_models as pf
from dist_scripts import shared_launch

pytestmark = pytest.mark.skipif(not pf.available(), reason="PaddleFormers is not installed")

STEPS, LR, RTOL, ATOL = 2, 0.5, 1e-4, 1e-6


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts", "pp_generic_worker.py")
DIST_JOBS = [{"name": "generic_pp2dp2", "dp": 2}, {"name": "generic_pp2tp2_zb", "tp": 2, "schedule": "ZB-H1"},
             {"name": "generic_pp2tp2_tied", "tp": 2, "tie": True},
             {"name": "generic_pp2dp2_tied", "dp": 2, "tie": True},
             {"name": "generic_pp2dp2_tied_zero2", "dp": 2, "tie": True, "sharding": 2}]
DIST = shared_launch.job(__name__, "pp_generic4", WORKER, 4, args=lambda out: [out, json.dumps(
    [dict(j, steps=STEPS, lr=LR) for j in DIST_JOBS])])


def llama(**overrides):
    return pf.build("llama", **dict(dict(tie_word_embeddings=False, num_hidden_layers=4), **overrides))


def data(step):
    return pf.batch(step, b=4, t=8)


def reference(**overrides):
    model = llama(**overrides)
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


_REF = {}


def ref(tie=False):
    if tie not in _REF:
        _REF[tie] = reference(tie_word_embeddings=tie)
    return _REF[tie]


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


def test_article_4d_hybrid_with_sequence_parallel_on_paddleformers_llama():
    """The article's DP x TP x PP with sequence parallelism, at 2 x 2 x 2 (micro-batches unset: the degree)."""
    from autoparallel.parallelize import apply_sp, resolve_tp_plan

    s = strategy(2, 2)
    s.sequence_parallel.enable = True
    model = llama()
    sp_only = set(apply_sp(model, resolve_tp_plan(model, 2, None))) - set(resolve_tp_plan(model, 2, None))
    assert any("norm" in n for n in sp_only)               # SP adds styles on the norms: it really runs
    ref_losses, ref_params = ref()
    with ap.simulate(world_size=8):
        losses, pipe = train(model, s)
        bad = mismatches(pipe, ref_params)
    assert pipe.plan.micro_batches == 2
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=1e-6)
    assert bad == []


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


def test_tied_embedding_across_stage_meshes_stays_refused_in_the_simulated_world():
    """Simulated world: a tied parameter cannot live on two stage meshes of one process (on real ranks each stage
    rank holds its own copy: the launch's ``generic_pp2dp2_tied`` jobs)."""
    for dp, tp in ((1, 2), (2, 1)):
        with ap.simulate(world_size=4), pytest.raises(NotImplementedError, match="model.embed_tokens.weight.*untie "
                                                                                 "them, or run on real ranks"):
            train(llama(tie_word_embeddings=True), strategy(dp, tp))


class _BarePosition(nn.Layer):
    """nanoGPT-style, untied: a bare position parameter on the root, blocks in a Sequential."""

    class Block(nn.Layer):
        def __init__(self, d):
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

        def forward(self, x):
            return x + F.gelu(self.fc(self.ln(x)))

    def __init__(self, d=16, layers=4):
        super().__init__()
        paddle.seed(0)
        self.wte = nn.Embedding(pf.VOCAB, d)
        self.pos = self.create_parameter([8, d], default_initializer=nn.initializer.Normal(std=0.5))
        self.h = nn.Sequential(*[self.Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, pf.VOCAB)

    def forward(self, ids):
        return self.head(self.h(self.wte(ids) + self.pos[: ids.shape[1]]))


def _bare_position_run(world, dp):
    model = _BarePosition()
    opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
    with ap.simulate(world_size=world):
        pipe, opt = ap.parallelize(model, opt, strategy=strategy(dp, 1))
        losses = []
        for step in range(STEPS):
            losses.append(pipe.train_batch(*data(step)))
            opt.step()
            opt.clear_grad()
        return losses, {n: (p.full() if hasattr(p, "full") else p).numpy() for n, p in pipe.named_parameters()}


@pytest.mark.parametrize("broken", [False, True], ids=["repointed", "negative-control"])
def test_bare_root_parameter_under_data_parallel(broken, monkeypatch):
    """The first stage registers ``pos`` (a parameter of the model root) on a container of its own; sharding
    replaces it there, and the model's forward, which reads ``self.pos``, must see the replacement. Without
    repointing the model (the negative control) the model trains a copy the optimizer never sees."""
    from autoparallel.parallel.pipeline import wiring

    want_losses, want = _bare_position_run(2, 1)                 # pipeline without DP: the same objects
    if broken:
        monkeypatch.setattr(wiring, "_repoint_model", lambda model, before: None)
    losses, got = _bare_position_run(4, 2)
    same = np.allclose(losses, want_losses, rtol=RTOL, atol=1e-6) and \
        all(np.allclose(got[n], want[n], rtol=RTOL, atol=ATOL) for n in want)
    assert same != broken


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


def test_real_ranks_equal_one_process():
    """4 gloo ranks: every rank's losses and its stages' parameters (gathered) equal one process; together
    the ranks hold every parameter; the tied embedding / LM head ends equal on both pipeline ranks."""
    out, ranks = shared_launch.results(DIST)
    for r in ranks:
        for name, job in r["jobs"].items():
            assert "error" not in job, f"rank {r['rank']} job {name}:\n{job['error']}"
    for job in DIST_JOBS:
        ref_losses, ref_params = ref(job.get("tie", False))
        seen = set()
        for r in ranks:
            np.testing.assert_allclose(r["jobs"][job["name"]]["losses"], ref_losses, rtol=RTOL, atol=1e-6)
            got = np.load(os.path.join(out, f"{job['name']}.rank{r['rank']}.npz"))
            for n in got.files:
                np.testing.assert_allclose(got[n], ref_params[n], rtol=RTOL, atol=2e-5, err_msg=f"{job} {n}")
            seen |= set(got.files)
        assert seen == set(ref_params), job["name"]
