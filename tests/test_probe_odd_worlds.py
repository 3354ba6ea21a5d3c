"""World sizes that are not powers of two (3, 5, 6 ranks) and dims they do not divide (a batch of 10, a vocabulary of
131, 25 hidden units, 7 tokens under sequence parallelism, 4 layers over 3 pipeline stages), in the simulated world,
against the same code in one process: every loss and every parameter after a few optimizer steps.

Found wrong here (fixed): ``shard_optimizer(opt, ShardingStage1/2/3, gradient_accumulation_steps=k)`` divided the
accumulated gradients by ``k`` again although the loop divides its loss (as paddle's and ``shard_fn=None`` want), and
did so for part of the parameters only when some were already sharded over the sharding dim; the ZeRO optimizer's
``state_dict`` over an unevenly split tensor-parallel dim (ZeRO-1 over DP 2 x TP 3, vocabulary 131) gathered every
group's chunks with the first group's width (ValueError from the collective); ``model.set_state_dict`` of another
parallel model's (distributed) state dict into a ZeRO model wrote the shards only (stage 1/2: the next step wrote the
old fp32 masters back; stage 3: paddle's "Tensor not initialized" on the released parameters).

Checked and equal to one process: DP 3 / 5 / 6, TP 3, DP 2 x TP 3, DP 3 x TP 2 by hand annotations and by
``ap.parallelize`` with ZeRO 1/2/3 and clipping, HSDP, a PaddleFormers Llama under DP 2 x TP 3 + SP + ZeRO-2 (and
the refusal of 4 heads over TP 3), a 3-stage pipeline over 4 layers, checkpoints moved between worlds 3, 2 and 4,
and reshards between Shard / Replicate / Partial of odd shapes on 3 and 2 x 3 ranks with their gradients."""
import itertools
import re

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.checkpoint import load_merged_state_dict, load_state_dict, save_state_dict, training_state
from autoparallel.testing import paddleformers_models as pf

RTOL, ATOL = 1e-4, 2e-5
B, V, H = 10, 131, 25           # batch over 3 / 4 / 6 data ranks, vocabulary and hidden width over 3 model ranks


class MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, H), nn.Linear(H, 7)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class LM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, 12), nn.Linear(12, V)
        self.fc1, self.fc2 = nn.Linear(12, H), nn.Linear(H, 12)

    def forward(self, ids):
        e = self.emb(ids)
        return self.head(e + self.fc2(F.gelu(self.fc1(e))))


LM_PLAN = {"emb": ap.VocabParallelEmbedding(), "fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel(),
           "head": ap.ColWiseParallel()}


def _mlp_data(i):
    r = np.random.default_rng(i)
    return r.standard_normal((B, 12)).astype("float32"), r.integers(0, 7, (B,)).astype("int64")


def _lm_data(i, t=7):
    r = np.random.default_rng(i)
    return r.integers(0, V, (B, t)), r.integers(0, V, (B, t))


def _params(m):
    return {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in m.named_parameters()}


def _fit_mlp(m, opt, steps=3, acc=1, to_input=lambda t: t):
    """``steps`` optimizer steps of ``acc`` micro-batches each, the loss divided by ``acc`` in the loop."""
    losses = []
    for i in range(steps * acc):
        x, y = _mlp_data(i)
        loss = F.cross_entropy(m(to_input(paddle.to_tensor(x))), paddle.to_tensor(y))
        (loss / acc).backward()
        if (i + 1) % acc == 0:
            opt.step()
            opt.clear_grad()
        losses.append(float(loss))
    return losses, _params(m)


def _fit_lm(m, opt, steps=3, first=0, t=7):
    losses = []
    for i in range(first, first + steps):
        x, y = _lm_data(i, t)
        loss = F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def _adamw(ps, clip=None):
    return paddle.optimizer.AdamW(1e-2, parameters=ps, epsilon=1e-4, grad_clip=clip)


def _momentum(ps, clip=None):
    return paddle.optimizer.Momentum(1e-2, parameters=ps, grad_clip=clip)


def _clip():
    return paddle.nn.ClipGradByGlobalNorm(0.3)


def _same(got, want, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(got[0], want[0], rtol=rtol, atol=1e-6)
    assert sorted(got[1]) == sorted(want[1])
    for n, v in want[1].items():
        np.testing.assert_allclose(got[1][n], v, rtol=rtol, atol=atol, err_msg=n)


_REF = {}


def _mlp_reference(make_opt, acc=1, clip=False):
    key = (make_opt, acc, clip)
    if key not in _REF:
        paddle.seed(0)
        m = MLP()
        _REF[key] = _fit_mlp(m, make_opt(m.parameters(), _clip() if clip else None), acc=acc)
    return _REF[key]


MESHES = {"dp3": ([0, 1, 2], ["dp"]), "dp5": ([0, 1, 2, 3, 4], ["dp"]), "dp6": ([0, 1, 2, 3, 4, 5], ["dp"]),
          "tp3": ([0, 1, 2], ["mp"]), "dp2xtp3": ([[0, 1, 2], [3, 4, 5]], ["dp", "mp"]),
          "dp3xtp2": ([[0, 1], [2, 3], [4, 5]], ["dp", "mp"])}
STAGES = {0: None, 1: ap.ShardingStage1, 2: ap.ShardingStage2, 3: ap.ShardingStage3}


def _tp_fn(tp_dim):
    """Megatron's layouts by hand on mesh dim ``tp_dim`` (None: everything replicated)."""
    def shard_fn(name, layer, mesh):
        if tp_dim is None:
            return
        place = lambda d: [ap.Replicate()] * tp_dim + [ap.Shard(d)]          # noqa: E731
        if name == "fc1":
            layer.weight = ap.shard_tensor(layer.weight, mesh, place(1))
            layer.bias = ap.shard_tensor(layer.bias, mesh, place(0))
        elif name == "fc2":
            layer.weight = ap.shard_tensor(layer.weight, mesh, place(0))
    return shard_fn


def _split_fn(name, layer, mesh):
    """fc1's weight already sharded over the ZeRO dim (its states stay in that layout: a SplitOptimizer)."""
    if name == "fc1":
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(1)])


def _hand(mesh_name, make_opt, stage=0, acc=1, clip=False, shard_fn=None):
    ranks, names = MESHES[mesh_name]
    with ap.simulate(world_size=int(np.size(ranks))):
        mesh = ap.ProcessMesh(ranks, dim_names=names)
        paddle.seed(0)
        fn = shard_fn or _tp_fn(len(names) - 1 if "mp" in names else None)
        m = ap.shard_layer(MLP(), mesh, fn)
        stage_fn = STAGES[stage]("dp", mesh) if stage else None
        opt = ap.shard_optimizer(make_opt(m.parameters(), _clip() if clip else None), stage_fn,
                                 gradient_accumulation_steps=acc)
        place = [ap.Shard(0) if n == "dp" else ap.Replicate() for n in names]
        return _fit_mlp(m, opt, acc=acc, to_input=lambda x: ap.shard_tensor(x, mesh, place))


# ---- found: ZeRO through shard_optimizer divided accumulated gradients again -----------------------------------
@pytest.mark.parametrize("mesh_name,stage,split", [("dp3", 1, False), ("dp6", 2, False), ("dp3", 3, False),
                                                   ("dp3", 2, True)])
def test_shard_optimizer_zero_with_accumulation_equals_one_process(mesh_name, stage, split):
    """paddle's loop: ``(loss / k).backward()`` k times, then ``step()``; the ZeRO step must not divide again.
    Momentum SGD (not scale-invariant, no clip), 10 samples over 3 or 6 data ranks."""
    got = _hand(mesh_name, _momentum, stage, acc=2, shard_fn=_split_fn if split else None)
    _same(got, _mlp_reference(_momentum, acc=2))


# ---- checked: hand annotations and ap.parallelize over 3, 5 and 6 ranks ------------------------------------------
@pytest.mark.parametrize("mesh_name,stage,make_opt,clip", [
    ("dp5", 0, _adamw, False), ("tp3", 0, _adamw, True), ("dp2xtp3", 1, _adamw, True),
    ("dp3xtp2", 2, _momentum, True), ("dp6", 3, _adamw, True), ("dp2xtp3", 3, _momentum, False)])
def test_hand_annotations_on_odd_meshes_equal_one_process(mesh_name, stage, make_opt, clip):
    _same(_hand(mesh_name, make_opt, stage, clip=clip), _mlp_reference(make_opt, clip=clip))


def _strategy(dp, tp, zero=0, sp=False, degree=None):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree, s.sequence_parallel.enable = dp, tp, sp
    if zero:
        s.sharding.enable, s.sharding.stage, s.sharding.degree = True, zero, degree
    return s


def _lm(dp, tp, zero=0, sp=False, degree=None, seed=0, make_opt=_adamw):
    """(model, optimizer) of LM parallelized over dp x tp (call inside ap.simulate)."""
    paddle.seed(seed)
    m = LM()
    return ap.parallelize(m, make_opt(m.parameters()), strategy=_strategy(dp, tp, zero, sp, degree),
                          tp_plan=LM_PLAN if tp > 1 else None)


@pytest.fixture(scope="module")
def lm_reference():
    """One process: 3 AdamW steps, the state (paddle's names, from a fresh name scope), then 2 more steps' losses."""
    with paddle.utils.unique_name.guard():
        paddle.seed(0)
        m = LM()
        opt = _adamw(m.parameters())
    losses = _fit_lm(m, opt)
    params = _params(m)
    state = {k: np.asarray(v) for k, v in opt.state_dict().items() if k != "LR_Scheduler"}
    return losses, params, state, _fit_lm(m, opt, 2, first=3)


@pytest.mark.parametrize("dp,tp,zero,sp,degree", [(1, 3, 0, True, None), (2, 3, 3, False, None),
                                                  (6, 1, 2, False, 3)])
def test_parallelize_uneven_vocab_and_hidden_equals_one_process(lm_reference, dp, tp, zero, sp, degree):
    with ap.simulate(world_size=dp * tp):
        m, opt = _lm(dp, tp, zero, sp, degree)
        got = _fit_lm(m, opt), _params(m)
    _same(got, lm_reference[:2])


# ---- found: the ZeRO state dict over an uneven tensor-parallel split; set_state_dict into ZeRO ------------------
def _by_accumulator(state: dict) -> dict:
    """The state keyed without paddle's name counter (``..._moment1_0`` -> ``..._moment1``): the counter an
    accumulator gets depends on how many were made before in the process, which the suite's order decides."""
    out = {re.sub(r"_\d+$", "", k): v for k, v in state.items()}
    assert len(out) == len(state), sorted(state)
    return out


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_state_dict_over_uneven_tensor_parallel_equals_one_process(lm_reference, zero):
    """DP 2 x TP 3 (131 vocabulary rows: 44, 44, 43): the gathered optimizer state is the one process's, and the
    live state dicts resume a fresh model as the run continues."""
    _, _, want_state, want_next = lm_reference
    with ap.simulate(world_size=6):
        with paddle.utils.unique_name.guard():
            m, opt = _lm(2, 3, zero)
            _fit_lm(m, opt)
            full = ap.full_state_dict(opt)
            model_sd, opt_sd = m.state_dict(), opt.state_dict()
        with paddle.utils.unique_name.guard():
            m2, opt2 = _lm(2, 3, zero, seed=5)
            _fit_lm(m2, opt2, 1)                                  # other values, the accumulators created
            m2.set_state_dict(model_sd)
            opt2.set_state_dict(opt_sd)
            resumed = _fit_lm(m2, opt2, 2, first=3)
    got = _by_accumulator({k: v for k, v in full.items() if k != "LR_Scheduler"})
    want = _by_accumulator(want_state)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_allclose(np.asarray(got[k]), v, rtol=RTOL, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(resumed, want_next, rtol=RTOL)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_set_state_dict_of_another_layout_into_zero_equals_one_process(zero):
    """A TP 3 model's state dict (distributed values) into a DP 3 ZeRO model, then two SGD steps: as one process
    loading the same weights (stage 1/2 kept the loaded shards only until the step wrote the old masters back)."""
    sgd = lambda ps: paddle.optimizer.SGD(0.1, parameters=ps)           # noqa: E731
    with paddle.utils.unique_name.guard():
        paddle.seed(0)
        src = LM()
        _fit_lm(src, _adamw(src.parameters()))
        paddle.seed(5)
        ref = LM()
        ref.set_state_dict(src.state_dict())
        want = _fit_lm(ref, sgd(ref.parameters()), 2, first=3)
    with ap.simulate(world_size=3):
        with paddle.utils.unique_name.guard():
            s, s_opt = _lm(1, 3)
            _fit_lm(s, s_opt)
        with paddle.utils.unique_name.guard():
            m, opt = _lm(3, 1, zero, seed=5, make_opt=sgd)
            _fit_lm(m, opt, 1, first=9)
            m.set_state_dict(s.state_dict())
            got = _fit_lm(m, opt, 2, first=3)
    np.testing.assert_allclose(got, want, rtol=RTOL)


# ---- checked: checkpoints between worlds 3, 2 and 4 -----------------------------------------------------------
def test_checkpoint_moves_between_worlds_3_2_and_4(tmp_path, lm_reference):
    _, want_params, _, want_next = lm_reference
    with ap.simulate(world_size=3):
        m, opt = _lm(3, 1, 3)                                     # ZeRO-3 over 3 ranks: padded chunks
        _fit_lm(m, opt)
        save_state_dict(training_state(m, opt), str(tmp_path / "w3"))
    merged = load_merged_state_dict(str(tmp_path / "w3"), flat=True)
    for n, v in want_params.items():
        np.testing.assert_allclose(merged["model/" + n], v, rtol=RTOL, atol=ATOL, err_msg=n)
    src = "w3"
    for i, (dp, tp, zero) in enumerate([(1, 2, 0), (2, 2, 2), (1, 3, 0)]):      # world 2, world 4, back to 3
        with ap.simulate(world_size=dp * tp):
            m, opt = _lm(dp, tp, zero, seed=7)
            load_state_dict(training_state(m, opt), str(tmp_path / src))
            got = _params(m)
            save_state_dict(training_state(m, opt), str(tmp_path / f"c{i}"))
            nxt = _fit_lm(m, opt, 2, first=3)
        for n, v in want_params.items():
            np.testing.assert_allclose(got[n], v, rtol=RTOL, atol=ATOL, err_msg=(dp, tp, n))
        np.testing.assert_allclose(nxt, want_next, rtol=RTOL)
        src = f"c{i}"


# ---- checked: a PaddleFormers Llama with 6 heads and 3 kv heads; 4 heads over TP 3 refused ------------------------
LLAMA = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96, vocab_size=V)


def _fit_pf(m, opt):
    losses = []
    for i in range(2):
        ids, labels = _lm_data(i)
        loss = pf.loss_of(m(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, _params(m)


@pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")
def test_paddleformers_llama_dp2_tp3_sp_zero2_equals_one_process():
    m = pf.build("llama", 0, **LLAMA)
    want = _fit_pf(m, _adamw(m.parameters()))
    with ap.simulate(world_size=6):
        m = pf.build("llama", 0, **LLAMA)
        m, opt = ap.parallelize(m, _adamw(m.parameters()), strategy=_strategy(2, 3, 2, sp=True))
        got = _fit_pf(m, opt)
    _same(got, want, rtol=2e-4, atol=3e-5)
    with ap.simulate(world_size=3):
        m = pf.build("llama", 0, **dict(LLAMA, num_attention_heads=4, num_key_value_heads=2))
        with pytest.raises(ValueError, match="tensor_parallel.degree=3 must divide the model's heads=4"):
            ap.parallelize(m, _adamw(m.parameters()), strategy=_strategy(1, 3))


# ---- checked: 3 pipeline stages over 4 layers; reshards of odd shapes -----------------------------------------
def test_three_stage_pipeline_over_four_layers_equals_one_process():
    from autoparallel.parallel.pipeline.runtime import apply_pp
    from examples.models import GPT, GPTConfig

    def build():
        paddle.seed(0)
        return GPT(GPTConfig(vocab_size=V, hidden=16, layers=4, heads=2, max_positions=8))

    data = [_lm_data(i, t=8) for i in range(2)]
    m = build()
    opt = _adamw(m.parameters())
    want = _fit_lm(m, opt, 2, t=8), _params(m)
    s = ap.Strategy()
    s.data_parallel.degree, s.pipeline_parallel.degree, s.pipeline_parallel.micro_batches = 2, 3, 5
    s.pipeline_parallel.schedule = "1F1B"
    with ap.simulate(world_size=6):
        pipe = apply_pp(build(), s)
        popt = pipe.wrap_optimizer(_adamw(pipe.parameters()))
        losses = []
        for x, y in data:
            losses.append(pipe.train_batch(x, y))
            popt.step()
            popt.clear_grad()
        got = losses, {n: p.full().numpy() for n, p in pipe.named_parameters()}
    _same(got, want)


PLACEMENTS = [ap.Shard(0), ap.Shard(1), ap.Replicate(), ap.Partial()]


@pytest.mark.parametrize("ranks", [[0, 1, 2], [[0, 1, 2], [3, 4, 5]]], ids=["3", "2x3"])
def test_reshard_of_odd_shapes_keeps_values_and_gradients(ranks):
    x = (np.arange(35, dtype="float32").reshape(7, 5) / 10)
    w = paddle.to_tensor(np.random.default_rng(0).standard_normal((7, 5)).astype("float32"))
    t = paddle.to_tensor(x, stop_gradient=False)
    (paddle.sin(t) * w).sum().backward()
    want = t.grad.numpy()
    with ap.simulate(world_size=int(np.size(ranks))):
        mesh = ap.ProcessMesh(ranks)
        nd = len(mesh.shape)
        for src in itertools.product(PLACEMENTS[:3], repeat=nd):
            for dst in itertools.product(PLACEMENTS, repeat=nd):
                d = ap.shard_tensor(paddle.to_tensor(x), mesh, list(src))
                d.stop_gradient = False
                y = ap.reshard(d, mesh, list(dst))
                np.testing.assert_allclose(y.full().numpy(), x, rtol=1e-6, err_msg=f"{src} -> {dst}")
                (paddle.sin(y) * w).sum().backward()
                np.testing.assert_allclose(d.grad.full().numpy(), want, rtol=1e-5, atol=1e-6, err_msg=f"{src} -> {dst}")


def test_dtensor_from_local_with_uneven_shards_names_global_shape():
    """Shards of 3, 3 and 2 rows on 3 ranks: without ``global_shape`` the shape is read as 3 x 3 rows and refused
    with the way out; with it, the tensor is the rows stacked."""
    parts = {0: paddle.ones([3, 2]), 1: paddle.ones([3, 2]) * 2, 2: paddle.ones([2, 2]) * 3}
    with ap.simulate(world_size=3):
        mesh = ap.ProcessMesh([0, 1, 2], dim_names=["x"])
        with pytest.raises(ValueError, match=r"expected \[3, 2\].*pass the global shape, global_shape="):
            ap.dtensor_from_local(parts, mesh, [ap.Shard(0)])
        d = ap.dtensor_from_local(parts, mesh, [ap.Shard(0)], global_shape=[8, 2])
        want = np.concatenate([p.numpy() for p in parts.values()])
        np.testing.assert_array_equal(d.full().numpy(), want)
