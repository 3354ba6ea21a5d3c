"""Recompute in the forms a user writes, with dropout > 0 and ``paddle.seed`` fixed, trained 3 steps under
DP 2 x TP 2 x ZeRO-3 (simulated 4 ranks) against one process without recompute (losses, the generator's next draw
and every final parameter, 1e-5):

* ``paddle.distributed.fleet.utils.recompute(fn, *args, use_reentrant=True/False)`` with keyword and non-tensor
  arguments, a block returning a tuple or a dict, a stop_gradient tensor among the inputs, random ops (dropout on
  a tensor-parallel shard, ``bernoulli``, ``randn_like``) inside the region; ``recompute_sequential``;
* a user's recompute call (reentrant or not) inside a ``Strategy.recompute`` / ``ap.recompute_layers`` region,
  and a PaddleFormers model's own non-reentrant recompute under ``Strategy.recompute``: it raised paddle's
  "saved_tensors_hooks only one pair of hooks is allowed at a time";
* BatchNorm's running mean and variance in a recomputed block update once per step (the re-run updated them
  again), also under ZeRO-3;
* ``ap.recompute_layers`` with k not dividing the block count, applied twice, after ``parallelize``;
* PaddleFormers ``recompute_granularity`` full / full_attn / core_attn, ``recompute_modules``,
  ``refined_recompute``; pipeline parallel 2 with recompute equals the same pipeline without;
* paddle's ``Strategy.recompute`` fields (``refined_ops_patterns``, ``no_recompute_segments``, ...) refused by name;
* on 4 real gloo ranks (tests/dist_scripts/recompute6_worker.py): four of the forms above against one process.
"""
import dataclasses
import os
import pathlib

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest
from paddle.distributed.fleet.utils import recompute as fleet_recompute

import autoparallel as ap
from autoparallel.parallel.recompute import recompute_layers
from dist_scripts import shared_launch
from examples.models import PRESETS, build
from recompute6_worker import CASES, plain_for, sgd_steps
from recompute6_worker import train as worker_train

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts", "recompute6_worker.py")
JOB = shared_launch.job(__name__, "recompute6", WORKER, 4, args=lambda out: [out], timeout=200)

STEPS = 3


def gpt(p=0.2, layers=3):
    paddle.seed(0)
    return build(dataclasses.replace(PRESETS["gpt-tiny"], vocab_size=64, layers=layers, max_positions=16, dropout=p))


def value(t):
    return (t.full() if ap.is_dist(t) else t).numpy()


def strategy(rc=None, every=1):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = 2, 2
    s.sharding.enable, s.sharding.stage = True, 3
    if rc:
        s.recompute.enable, s.recompute.granularity, s.recompute.checkpoint_every_n_layers = True, rc, every
    return s


def train(model, s=None, after=None):
    """(losses of STEPS SGD steps + the generator's next draw, {name: final parameter}); ``after`` is applied to
    the model returned by parallelize."""
    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    if s is not None:
        model, opt = ap.parallelize(model, opt, strategy=s)
    if after is not None:
        model = after(model)
    return sgd_steps(model, opt), {n: value(p) for n, p in model.named_parameters()}


def assert_same(got, ref):
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for k, v in ref[1].items():
        np.testing.assert_allclose(got[1][k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def dist(build_model, s=None, after=None):
    with ap.simulate(world_size=4):
        return train(build_model(), strategy() if s is None else s, after)


# ---- fleet.utils.recompute in a block's forward -----------------------------------------------------------------
def _kwargs(orig, x, re):
    return fleet_recompute(lambda h, scale: orig(h) * scale, x, scale=1.0, use_reentrant=re)


def _non_tensor(orig, x, re):
    return fleet_recompute(lambda h, s, act, flag: (F.gelu(orig(h)) if act == "gelu" else orig(h)) * s,
                           x, 1.0, "none", True, use_reentrant=re)


def _tuple(orig, x, re):
    y, aux = fleet_recompute(lambda h: (orig(h), h.mean()), x, use_reentrant=re)
    return y + 0 * aux


def _dict(orig, x, re):
    d = fleet_recompute(lambda h: {"y": orig(h), "aux": h.mean()}, x, use_reentrant=re)
    return d["y"] + 0 * d["aux"]


def _stop_gradient_mask(orig, x, re):
    m = paddle.ones([x.shape[-1]], dtype=x.dtype)
    m.stop_gradient = True
    return fleet_recompute(lambda h, mask: orig(h) * mask, x, m, use_reentrant=re)


FORMS = {"kwargs": _kwargs, "non-tensor args": _non_tensor, "tuple out": _tuple, "dict out": _dict,
         "stop_gradient mask": _stop_gradient_mask}


def user_blocks(model, form, re):
    for b in model.blocks:
        b.forward = (lambda orig: lambda x: FORMS[form](orig, x, re))(b.forward)
    return model


@pytest.fixture(scope="module")
def reference():
    return train(gpt())


@pytest.mark.parametrize("re", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("form", list(FORMS))
def test_fleet_recompute_call_forms_under_tp_dp_zero3(form, re, reference):
    assert_same(dist(lambda: user_blocks(gpt(), form, re)), reference)
    if not (form == "dict out" and re):         # paddle's reentrant PyLayer returns tensors only (one process)
        assert_same(train(user_blocks(gpt(), form, re)), reference)


def test_dropout_acts_in_the_reference(reference):
    plain = train(gpt(0.0))
    assert max(abs(a - b) for a, b in zip(plain[0][:STEPS], reference[0][:STEPS])) > 1e-4
    assert max(float(np.abs(plain[1][k] - v).max()) for k, v in reference[1].items()) > 1e-3


def test_stop_gradient_input_gets_the_gradients_of_the_block_without_recompute():
    """``recompute(block, x.detach())``: no input needs a gradient, the block's parameters still do. Paddle's
    reentrant recompute in one process drops them (its output comes out stop_gradient); on distributed tensors the
    call runs the non-reentrant recompute, which gives the gradients of the block without recompute."""
    def blocks(re):
        def make():
            m = gpt()
            for b in m.blocks:
                b.forward = (lambda orig: lambda x: (fleet_recompute(orig, x.detach(), use_reentrant=re)
                                                     if re is not None else orig(x.detach())) + x)(b.forward)
            return m
        return make

    ref = train(blocks(None)())
    for re in (True, False):
        assert_same(dist(blocks(re)), ref)
    assert_same(train(blocks(False)()), ref)
    one_reentrant = train(blocks(True)())            # paddle's own gradient loss, not reproduced above
    assert abs(one_reentrant[0][-2] - ref[0][-2]) > 1e-4


RANDOM = {
    "dropout on a TP shard": lambda h: F.dropout(h, 0.3),
    "dropout axis": lambda h: F.dropout(h, 0.3, axis=[0, 1]),
    "bernoulli": lambda h: h * paddle.bernoulli(paddle.full_like(h, 0.7)),
    "randn_like": lambda h: h + 0.1 * paddle.randn_like(h),
}


def random_mlp(rand, re):
    """Every block's MLP draws ``RANDOM[rand]`` on its column-parallel (TP-split) hidden activation."""
    def make():
        m = gpt(0.0)
        for b in m.blocks:
            def inner(x, mlp=b.mlp):
                return mlp.fc2(RANDOM[rand](F.gelu(mlp.fc1(x))))
            b.mlp.forward = inner if re is None else (lambda x, f=inner: fleet_recompute(f, x, use_reentrant=re))
        return m
    return make


@pytest.mark.parametrize("rand", list(RANDOM))
def test_random_ops_in_the_region_redraw_the_same_values(rand):
    ref = train(random_mlp(rand, None)())
    plain = train(gpt(0.0))
    assert max(float(np.abs(plain[1][k] - v).max()) for k, v in ref[1].items()) > 1e-3     # the draw acts
    assert_same(dist(random_mlp(rand, True)), ref)
    assert_same(dist(random_mlp(rand, False)), ref)
    assert_same(dist(random_mlp(rand, None), strategy(rc="full")), ref)


# ---- a recompute call inside a recompute region ------------------------------------------------------------------
@pytest.mark.parametrize("re", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("outer", ["strategy full", "strategy selective", "recompute_layers"])
def test_user_recompute_nested_in_a_region_runs_plainly(outer, re):
    """The inner non-reentrant call raised paddle's "only one pair of hooks is allowed at a time" (both
    ``Strategy.recompute`` and ``ap.recompute_layers``, in one process as well)."""
    ref = train(random_mlp("dropout on a TP shard", None)())
    if outer == "recompute_layers":
        def make():
            return recompute_layers(random_mlp("dropout on a TP shard", re)(), None, 2)
        assert_same(train(make()), ref)
        assert_same(dist(make), ref)
    else:
        assert_same(dist(random_mlp("dropout on a TP shard", re), strategy(rc=outer.split()[1])), ref)


@pytest.mark.parametrize("world", [1, 4])
def test_region_inside_a_users_non_reentrant_recompute(world):
    """A user's non-reentrant recompute around the blocks of ``ap.recompute_layers``: the regions inside it raised
    paddle's "only one pair of hooks is allowed at a time" (in one process as well)."""
    ref = train(random_mlp("dropout on a TP shard", None)())

    def make():
        m = recompute_layers(random_mlp("dropout on a TP shard", None)(), None, 2)
        blocks = list(m.blocks)

        def run_blocks(h):
            for b in blocks:
                h = b(h)
            return h
        m.embed, m.head = m.embed, m.head
        m.forward = lambda ids: m.head(fleet_recompute(run_blocks, m.embed(ids), use_reentrant=False))
        return m

    assert_same(train(make()) if world == 1 else dist(make), ref)


# ---- BatchNorm's running statistics in a recomputed block -------------------------------------------------------
class BNBlock(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 8), nn.BatchNorm1D(8)

    def forward(self, x):
        return x + F.relu(self.bn(self.fc(x)))


class BNNet(nn.Layer):
    def __init__(self, user=None):
        super().__init__()
        paddle.seed(0)
        self.user = user
        self.blocks = nn.LayerList([BNBlock(), BNBlock()])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x) if self.user is None else fleet_recompute(b.forward, x, use_reentrant=self.user)
        return self.head(x)


def bn_train(model, s=None):
    """Losses of 3 SGD steps and every parameter, BatchNorm's running mean and variance among them."""
    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    if s is not None:
        model, opt = ap.parallelize(model, opt, strategy=s)
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((8, 8)).astype("float32"))
    losses = []
    for _ in range(STEPS):
        loss = (model(x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: value(p) for n, p in model.named_parameters()}


def _dp2(rc=False, zero=0):
    s = ap.Strategy()
    s.data_parallel.degree = 2
    s.recompute.enable = rc
    if zero:
        s.sharding.enable, s.sharding.stage = True, zero
    return s


BN_FORMS = {
    "recompute_layers, one process": lambda: bn_train(recompute_layers(BNNet(), None, 1)),
    "recompute_layers every 2, one process": lambda: bn_train(recompute_layers(BNNet(), None, 2)),
    "strategy full, dp2": lambda: _in_world(2, lambda: bn_train(BNNet(), _dp2(True))),
    "strategy full, dp2 ZeRO-3": lambda: _in_world(2, lambda: bn_train(BNNet(), _dp2(True, zero=3))),
    "user reentrant, dp2": lambda: _in_world(2, lambda: bn_train(BNNet(True), _dp2())),
    "user non-reentrant, dp2": lambda: _in_world(2, lambda: bn_train(BNNet(False), _dp2())),
}


def _in_world(n, fn):
    with ap.simulate(world_size=n):
        return fn()


@pytest.mark.parametrize("form", list(BN_FORMS))
def test_batchnorm_running_statistics_update_once(form):
    """The re-run in backward updated BatchNorm's running mean and variance (non-trainable parameters, written in
    place) a second time: the statistics were those of two forwards per step (under ZeRO-3 the re-run's update
    was written to the parameter chunks again)."""
    ref = bn_train(BNNet())
    assert_same(BN_FORMS[form](), ref)


# ---- ap.recompute_layers ---------------------------------------------------------------------------------------
def _block_pred(layer):
    return type(layer).__name__ == "Block"


LAYERS = {
    "k=2 of 3 blocks": (lambda m: recompute_layers(m, _block_pred, 2), None),
    "k=5 of 3 blocks": (lambda m: recompute_layers(m, _block_pred, 5), None),
    "applied twice (1 then 3)": (lambda m: recompute_layers(recompute_layers(m, _block_pred, 1), _block_pred, 3), None),
    "applied twice (2, None)": (lambda m: recompute_layers(recompute_layers(m, _block_pred, 2), None, 2), None),
    "after parallelize": (None, lambda m: recompute_layers(m, _block_pred, 2)),
    "after parallelize, list": (None, lambda m: recompute_layers(m, lambda mm: list(mm.blocks), 2)),
}


@pytest.mark.parametrize("case", list(LAYERS))
def test_recompute_layers_forms(case, reference):
    before, after = LAYERS[case]
    calls = []

    def make():
        m = gpt()
        for b in m.blocks:
            b.mlp.register_forward_post_hook(lambda *_: calls.append(1))
        return before(m) if before else m

    assert_same(dist(make, after=after), reference)
    assert len(calls) == 2 * 3 * STEPS          # every block's forward once more in backward, never a third time


def test_recompute_layers_matching_nothing_raises():
    with pytest.raises(ValueError, match="matched no layer of GPT"):
        recompute_layers(gpt(), lambda layer: isinstance(layer, nn.Conv2D))
    with pytest.raises(ValueError, match="non-empty list"):
        recompute_layers(gpt(), lambda m: [])


# ---- recompute_sequential --------------------------------------------------------------------------------------
class Seq(nn.Layer):
    def __init__(self, segments=None):
        super().__init__()
        paddle.seed(0)
        self.segments = segments
        self.emb, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)
        self.seq = nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 16))
                                   for _ in range(3)])

    def forward(self, ids):
        from paddle.distributed.fleet.recompute import recompute_sequential

        h = self.emb(ids)
        h = self.seq(h) if self.segments is None else recompute_sequential({"segments": self.segments}, self.seq, h)
        return self.head(h)


def test_recompute_sequential_one_segment():
    """``recompute_sequential({"segments": n}, seq, x)``: n = 1 equals one process without recompute. Paddle 3.3's
    own n >= 2 unpacks the first segment's output tensor as positional arguments (``TypeError: do_run() takes 1
    positional argument``), in one process as well, so it is not checked here."""
    ref = train(Seq())
    assert_same(train(Seq(1)), ref)
    assert_same(dist(lambda: Seq(1)), ref)


# ---- PaddleFormers' own recompute --------------------------------------------------------------------------------
def pf_train(name, s=None, **overrides):
    from autoparallel.testing import paddleformers_models as pf

    base = {"attention_dropout": 0.2, "recompute_method": "uniform", "recompute_num_layers": 1}
    model = pf.build(name, fill_zeros=True, **{**base, **overrides})
    opt = paddle.optimizer.SGD(0.05, parameters=model.parameters())
    if s is not None:
        model, opt = ap.parallelize(model, opt, strategy=s)
    ids, labels = pf.batch(0)
    paddle.seed(7)
    losses = []
    for _ in range(STEPS):
        loss = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses + [float(paddle.rand([1]))], {n: value(p) for n, p in model.named_parameters()}


PF_CONFIGS = {
    "full": dict(recompute_granularity="full"),
    "full_attn": dict(recompute_granularity="full_attn"),
    "core_attn": dict(recompute_granularity="core_attn"),
    "modules core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "refined_recompute": dict(recompute_granularity="full", refined_recompute={"mlp_row_ln": 1}),
    "full, non-reentrant": dict(recompute_granularity="full", recompute_use_reentrant=False),
}


@pytest.fixture(scope="module")
def pf_reference():
    from autoparallel.testing import paddleformers_models as pf

    if not pf.available():
        pytest.skip("paddleformers not installed (pip install -e .[models])")
    return {}


def pf_ref(cache, name):
    if name not in cache:
        cache[name] = pf_train(name)
    return cache[name]


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("cfg", list(PF_CONFIGS))
def test_paddleformers_own_recompute_configs(name, cfg, pf_reference):
    ref = pf_ref(pf_reference, name)
    with ap.simulate(world_size=4):
        assert_same(pf_train(name, strategy(), recompute=True, **PF_CONFIGS[cfg]), ref)


@pytest.mark.parametrize("re", [True, False], ids=["reentrant", "non-reentrant"])
def test_paddleformers_own_recompute_under_strategy_recompute(re, pf_reference):
    """DeepSeek-V3 passes ``config.recompute_use_reentrant`` to paddle's recompute around each decoder layer,
    whose forward is the strategy's region: the region inside the model's non-reentrant recompute raised paddle's
    "only one pair of hooks is allowed at a time"."""
    ref = pf_ref(pf_reference, "deepseek_v3")
    with ap.simulate(world_size=4):
        got = pf_train("deepseek_v3", strategy(rc="full"), recompute=True, recompute_granularity="full",
                       recompute_use_reentrant=re)
    assert_same(got, ref)


# ---- pipeline parallel -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rc,every", [("full", 1), ("full", 2), ("selective", 1)])
def test_pipeline_recompute_with_dropout_equals_the_pipeline_without(rc, every):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts"))
    import pp_common

    from autoparallel.parallel.pipeline.runtime import apply_pp
    from autoparallel.testing.models import tp_plan
    from examples.models import GPT, GPTConfig

    def run(recompute, calls):
        paddle.seed(0)
        model = GPT(GPTConfig(vocab_size=256, hidden=32, layers=4, heads=4, max_positions=pp_common.SEQ, dropout=0.2))
        for b in model.blocks:
            b.mlp.register_forward_post_hook(lambda *_: calls.append(1))
        s = pp_common.strategy({"schedule": "1F1B", "dp": 2, "tp": 2})
        if recompute:
            s.recompute.enable, s.recompute.granularity, s.recompute.checkpoint_every_n_layers = True, rc, every
        pipe = apply_pp(model, s, tp_plan=tp_plan("gpt"))
        opt = pipe.wrap_optimizer(paddle.optimizer.SGD(0.1, parameters=model.parameters()))
        paddle.seed(5)
        losses = []
        for x, y in pp_common.batches(STEPS):
            losses.append(pipe.train_batch(x, y))
            opt.step()
            opt.clear_grad()
        return losses + [float(paddle.rand([1]))], {n: value(p) for n, p in pipe.named_parameters()}

    plain, twice = [], []
    with ap.simulate(world_size=8):
        ref = run(False, plain)
        got = run(True, twice)
    assert_same(got, ref)
    if rc == "full":
        assert len(twice) > len(plain)          # the recomputed blocks ran again in backward


# ---- paddle's Strategy.recompute fields ------------------------------------------------------------------------------
@pytest.mark.parametrize("field,val", [("refined_ops_patterns", [{"main_ops": ["matmul"], "num": 1}]),
                                       ("no_recompute_segments", [0]), ("sr", 1), ("checkpoints", ["x"]),
                                       ("enable_tuning", True)])
def test_paddle_recompute_fields_refused_by_name(field, val):
    s = ap.Strategy()
    with pytest.raises(NotImplementedError, match=f"strategy.recompute.{field}="):
        setattr(s.recompute, field, val)
    with pytest.raises(NotImplementedError, match=f"strategy.recompute.{field}="):
        ap.Strategy({"recompute": {"enable": True, field: val}})
    setattr(s.recompute, field, [] if isinstance(val, list) else type(val)())      # paddle's default: accepted
    with pytest.raises(ValueError, match="granularity must be 'full' or 'selective', got 'core_attn'"):
        ap.Strategy({"recompute": {"enable": True, "granularity": "core_attn"}})


# ---- real ranks (gloo, 4 processes) -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real():
    out, ranks = shared_launch.results(JOB)
    return pathlib.Path(out), ranks


@pytest.mark.parametrize("case", CASES)
def test_real_ranks_equal_one_process_without_recompute(case, real):
    out, ranks = real
    losses, model = worker_train(plain_for(case))
    for res in ranks:
        got = res["cases"][case]
        assert "error" not in got, f"rank {res['rank']}: {got.get('error')}"
        np.testing.assert_allclose(got["losses"], losses, rtol=1e-5, atol=1e-6, err_msg=f"rank {res['rank']}")
    saved = np.load(out / f"{CASES.index(case)}.npz")
    for n, p in model.named_parameters():
        np.testing.assert_allclose(saved["param/" + n], p.numpy(), rtol=1e-5, atol=1e-6, err_msg=n)
