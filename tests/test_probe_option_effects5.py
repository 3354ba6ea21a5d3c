"""Options a user can set that were accepted and then not honoured; each now acts or raises a typed error.

* paddle's ``strategy.gradient_merge.enable = True`` after ``strategy.gradient_accumulation_steps = k`` reset the
  steps to 1 (the step summed the k micro-steps' gradients instead of averaging them); ``gradient_merge.k_steps`` and
  ``gradient_accumulation_steps`` set to different values kept the later one silently, and
  ``gradient_merge.enable = False`` dropped steps set as ``gradient_accumulation_steps``.
* ``ap.PerformanceMonitor(num_stages=n, split=...)`` with a split of another length ignored ``num_stages``; a split
  with a gap or overlap, or ``layer_names`` of another length, was taken as given.
* ``ap.parallelize(model, opt, strategy=s, mesh=mesh, config={"dp_config": {"sharding_level": n}})``: the config's
  level replaced the strategy's ZeRO stage, or (0 / None) was dropped while the strategy's sharding ran.
* ``AP_WATCHDOG`` with a misspelt value (``of``, ``disable``) kept the watchdog running; ``AP_WATCHDOG_PEERS=0``
  watched no peer.
* ``ap.parallel_guard(dims)`` around a pipeline (``ap.parallelize`` with pp > 1) changed nothing: the pipeline
  cuts its batches over each stage's data ranks itself.
* a plain paddle optimizer stepping a model built by ``ap.DataParallel(model, strategy=s)`` whose ``ap.Optimizer``
  was never called ran a data-parallel step only: ``sharding.*``, ``gradient_accumulation_steps``, float16 loss
  scaling and ``checkpoint.*`` were ignored.
* ``ap.Optimizer(opt, strategy=ap.Strategy(seed=n))`` over a model not built by ``ap.DataParallel`` accepted the
  seed and did not apply it.
* a misspelt key of the ``Strategy({...})`` dict form raised AttributeError (``Strategy.from_dict`` and an
  unknown section: ValueError); it is a ValueError naming the valid keys.
* a ``paddle.distributed.Strategy(config)`` given to an entry point: keys paddle stores but never reads (an unknown
  section, a misspelt field) were dropped by the field-by-field conversion.
* ``ap.to_static(..., tp_plan=...)`` with ``tensor_parallel.degree = 1`` or ``auto_mode='full'`` dropped the plan
  (``ap.parallelize`` refuses the first); ``sequence_parallel.enable`` on a model without norm layers changed
  nothing (to_static's sequence parallelism is the norms' outputs on sequence shards).

Real ranks: one 2-rank job (tests/dist_scripts/option_effects5_worker.py): the merged steps under DP2 against a
plain one-process loop, a plain optimizer over a sharded ap.DataParallel model and the guard around a pipeline
refused on both ranks.
"""
import os
import pathlib
import re
import sys
import types

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel import watchdog
from autoparallel.graph.to_static import to_static
from autoparallel.testing.models import batch, build
from dist_scripts import shared_launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_scripts", "option_effects5_worker.py")
JOB = shared_launch.job(__name__, "option_effects5", WORKER, 2, args=lambda out: [out], timeout=120)
sys.path.insert(0, os.path.join(HERE, "dist_scripts"))
from option_effects5_worker import LR, merge_reference  # noqa: E402


# ---- gradient_merge (paddle's name for the accumulation steps) ------------------------------------------------
def test_gradient_merge_enable_keeps_the_accumulation_steps_already_set():
    s = ap.Strategy()
    s.gradient_accumulation_steps = 4
    s.gradient_merge.enable = True
    assert s.gradient_accumulation_steps == 4 and s.gradient_merge.k_steps == 4
    d = ap.Strategy({"gradient_accumulation_steps": 3, "gradient_merge": {"enable": True}})
    assert d.gradient_accumulation_steps == 3
    for merge in ({"enable": True, "k_steps": 2}, {"k_steps": 2, "enable": True}):
        assert ap.Strategy({"gradient_merge": merge}).gradient_accumulation_steps == 2
    s.gradient_merge.enable = False                   # paddle's switch off: no accumulation
    assert s.gradient_accumulation_steps == 1
    t = ap.Strategy()
    t.gradient_accumulation_steps = 4                 # set by our name: paddle's switch cannot silently drop it
    with pytest.raises(ValueError, match=r"gradient_merge.enable=False but .*gradient_accumulation_steps=4"):
        t.gradient_merge.enable = False
    assert t.gradient_accumulation_steps == 4


def test_gradient_merge_k_steps_and_accumulation_steps_disagreeing_are_refused():
    s = ap.Strategy({"gradient_merge": {"enable": True, "k_steps": 2}, "gradient_accumulation_steps": 4})
    with pytest.raises(ValueError, match=r"gradient_merge.k_steps=2 and gradient_accumulation_steps=4"):
        s.validate(world_size=2)
    s.gradient_accumulation_steps = 2
    assert s.validate(world_size=2).num_micro_batches == 2
    t = ap.Strategy()
    t.gradient_merge.enable = True
    t.gradient_merge.k_steps = 2
    t.gradient_accumulation_steps = 3
    with pytest.raises(ValueError, match=r"k_steps=2 and gradient_accumulation_steps=3"):
        t.validate(world_size=1)


@pytest.mark.parametrize("config, names", [
    ({"sharding": {"enable": True, "stagee": 2}}, ["sharding has no field 'stagee'", "did you mean 'stage'"]),
    ({"seeed": 1}, ["Strategy has no field 'seeed'", "did you mean 'seed'"]),
    ({"pipeline": {"pp_degre": 2}}, ["pipeline has no field 'pp_degre'", "pp_degree"]),
    ({"gradient_merge": {"k_step": 2}}, ["gradient_merge has no field 'k_step'", "k_steps"]),
    ({"amp": {"enable": True, "dtyp": "float16"}}, ["amp has no field 'dtyp'", "did you mean 'dtype'"]),
    ({"shardin": {"enable": True}}, ["unknown section 'shardin'", "sharding", "gradient_merge"]),
])
def test_misspelt_keys_of_the_config_dict_are_value_errors(config, names):
    """As ``Strategy.from_dict``: a key of the dict form that names nothing is a ValueError naming the valid ones."""
    with pytest.raises(ValueError) as e:
        ap.Strategy(config)
    assert str(e.value).startswith("Strategy(config): ") and all(n in str(e.value) for n in names), str(e.value)


@pytest.mark.parametrize("config, names", [
    ({"tuning": {"enable": True}}, ["unknown section 'tuning'"]),
    ({"sharding": {"enable": True, "stagee": 2}}, ["sharding has no field 'stagee'", "did you mean 'stage'"]),
    ({"pipeline": {"pp_degre": 2}}, ["pipeline has no field 'pp_degre'"]),
    ({"bogus": 4}, ["Strategy has no field 'bogus'"]),
])
def test_paddle_strategy_keys_paddle_never_read_are_refused(config, names):
    """paddle's ``dist.Strategy(config)`` keeps an unknown section or a misspelt field in its config dict and reads
    nothing from it; converted field by field, they were dropped. Handed to an entry point, they are refused."""
    import paddle.distributed as dist

    with ap.simulate(world_size=2):
        model = build("gpt")
        with pytest.raises(ValueError) as e:
            ap.parallelize(model, paddle.optimizer.SGD(LR, parameters=model.parameters()),
                           strategy=dist.Strategy(config))
    assert all(n in str(e.value) for n in names), str(e.value)
    known = dist.Strategy({"sharding": {"enable": True, "stage": 2}, "gradient_merge": {"enable": True, "k_steps": 2}})
    from autoparallel.api_strategy import from_paddle_strategy

    got = from_paddle_strategy(known)
    assert got.sharding.stage == 2 and got.gradient_accumulation_steps == 2


def _full(p):
    return ap.unshard_dtensor(p).numpy() if hasattr(p, "placements") else p.numpy()


def test_gradient_merge_enabled_after_the_steps_accumulates_in_training():
    """DP2 simulated: two backward passes, one step averaging them, equal to one process."""
    want = merge_reference()
    with ap.simulate(world_size=2):
        s = ap.Strategy()
        s.data_parallel.degree = 2
        s.gradient_accumulation_steps = 2
        s.gradient_merge.enable = True
        model = build("gpt")
        start = {n: p.numpy() for n, p in model.named_parameters()}
        model, opt = ap.parallelize(model, paddle.optimizer.SGD(LR, parameters=model.parameters()), strategy=s)
        for i in range(2):
            ids, lab = batch(i)
            F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean().backward()
        opt.step()
        assert max(float(np.abs(_full(p) - start[n]).max()) for n, p in model.named_parameters()) > 1e-3
        for n, p in model.named_parameters():
            np.testing.assert_allclose(_full(p), want[n], rtol=1e-5, atol=1e-6, err_msg=n)


# ---- ap.DataParallel without its ap.Optimizer -----------------------------------------------------------------
@pytest.mark.parametrize("option", ["sharding", "accumulation", "float16"])
@pytest.mark.parametrize("built_before", [False, True])
def test_plain_optimizer_over_a_data_parallel_model_with_optimizer_options_is_refused(option, built_before):
    """The strategy's optimizer side is ap.Optimizer's; a plain step (paddle's own optimizer, wrapped for data
    parallelism only) would skip ZeRO, the accumulation average or the loss scaling."""
    ids, lab = batch(0)
    with ap.simulate(world_size=2):
        s = ap.Strategy()
        s.data_parallel.degree = 2
        if option == "sharding":
            s.sharding.enable = True
        elif option == "accumulation":
            s.gradient_accumulation_steps = 2
        else:
            s.amp.enable, s.amp.dtype = True, "float16"
        model = build("gpt")
        opt = paddle.optimizer.SGD(LR, parameters=model.parameters()) if built_before else None
        model = ap.DataParallel(model, strategy=s)
        opt = opt or paddle.optimizer.SGD(LR, parameters=model.parameters())
        F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean().backward()
        with pytest.raises(ValueError, match=r"SGD.step over a model built by ap.DataParallel.*opt = ap.Optimizer"):
            opt.step()


def test_optimizer_without_a_data_parallel_model_applies_the_strategy_seed():
    """``ap.Optimizer(opt, strategy=s)`` over a shard_layer model accepts ``seed`` (and the accumulation steps); the
    seed was not applied."""
    with ap.simulate(world_size=2):
        layer = ap.shard_layer(paddle.nn.Linear(4, 4), ap.ProcessMesh([0, 1], dim_names=["data"]))
        opt = paddle.optimizer.SGD(LR, parameters=layer.parameters())
        paddle.seed(123)
        np.random.seed(123)
        ap.Optimizer(opt, strategy=ap.Strategy(seed=7))
        got, got_np = paddle.rand([3]).numpy(), np.random.rand()
    paddle.seed(7)
    np.random.seed(7)
    np.testing.assert_array_equal(got, paddle.rand([3]).numpy())
    assert got_np == np.random.rand()


def test_plain_optimizer_over_a_plain_data_parallel_model_still_trains():
    """Nothing of the optimizer side set: the plain step is the data-parallel step (equal to one process)."""
    ids, lab = batch(0)
    one = build("gpt")
    F.cross_entropy(one(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean().backward()
    paddle.optimizer.SGD(LR, parameters=one.parameters()).step()
    with ap.simulate(world_size=2):
        s = ap.Strategy()
        s.data_parallel.degree = 2
        model = ap.DataParallel(build("gpt"), strategy=s)
        opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
        F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean().backward()
        opt.step()
        got = {n: _full(p) for n, p in model.named_parameters()}
    for n, p in one.named_parameters():
        np.testing.assert_allclose(got[n], p.numpy(), rtol=1e-5, atol=1e-6, err_msg=n)


# ---- paddle's config form next to a strategy ------------------------------------------------------------------
@pytest.mark.parametrize("level, stage", [(1, 3), (0, 2), (None, 2)])
def test_dp_config_sharding_level_disagreeing_with_the_strategy_is_refused(level, stage):
    """Before: the config's level replaced the strategy's stage (1 over 3), or was dropped (0 / None: ZeRO-2 ran)."""
    with ap.simulate(world_size=2):
        s = ap.Strategy()
        s.sharding.enable, s.sharding.stage = True, stage
        model = build("gpt")
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        with pytest.raises(ValueError, match=rf"dp_config\['sharding_level'\]={level!r} disagrees with the "
                                             rf"strategy's sharding \(enable=True, stage={stage}\)"):
            ap.parallelize(model, paddle.optimizer.SGD(LR, parameters=model.parameters()), strategy=s, mesh=mesh,
                           config={"dp_config": {"sharding_level": level}})


def test_dp_config_sharding_level_agreeing_with_the_strategy_builds_zero():
    from autoparallel.checkpoint.state import wrapper_chain
    from autoparallel.parallel.sharding import ZeroOptimizer

    with ap.simulate(world_size=2):
        s = ap.Strategy()
        s.sharding.enable, s.sharding.stage = True, 2
        model = build("gpt")
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        _, opt = ap.parallelize(model, paddle.optimizer.SGD(LR, parameters=model.parameters()), strategy=s,
                                mesh=mesh, config={"dp_config": {"sharding_level": 2}})
        zero = [o for o in wrapper_chain(opt) if isinstance(o, ZeroOptimizer)]
        assert len(zero) == 1 and zero[0].stage == 2


# ---- PerformanceMonitor's stage arguments ---------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(num_stages=3, split=[(0, 2), (2, 4)]), "num_stages=3 but split has 2 stages"),
    (dict(split=[(0, 2), (3, 4)]), "split must list contiguous, non-empty"),
    (dict(split=[(1, 2), (2, 4)]), "split must list contiguous, non-empty"),
    (dict(split=[]), "split must list contiguous, non-empty"),
    (dict(split=[(0, 2), (2, 4)], layer_names=["a", "b", "c"]), "layer_names has 3 names but split covers 4"),
])
def test_performance_monitor_stage_arguments_that_disagree_are_refused(kwargs, message):
    """With a split, num_stages was not read (the split's length won) and a gap or overlap was timed as given."""
    with pytest.raises(ValueError, match=re.escape(message)):
        ap.PerformanceMonitor(**kwargs)
    mon = ap.PerformanceMonitor(num_stages=2, split=[(0, 2), (2, 4)], layer_names=list("abcd"))
    assert mon.num_stages == 2 and mon.split == [(0, 2), (2, 4)]


# ---- environment switches ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["of", "disable", "none"])
def test_misspelt_ap_watchdog_is_refused(monkeypatch, value):
    monkeypatch.setenv("AP_WATCHDOG", value)
    with pytest.raises(ValueError, match=rf"AP_WATCHDOG must be 'on' or 'off', got '{value}'"):
        watchdog.disabled()
    with pytest.raises(ValueError, match="AP_WATCHDOG"):
        with ap.simulate(world_size=2):
            ap.parallelize(build("gpt"), None, strategy=ap.Strategy())


@pytest.mark.parametrize("value, off", [("off", True), ("0", True), ("No", True), ("on", False), ("", False)])
def test_ap_watchdog_spellings(monkeypatch, value, off):
    monkeypatch.setenv("AP_WATCHDOG", value)
    assert watchdog.disabled() is off


@pytest.mark.parametrize("value", ["0", "-2", "four"])
def test_ap_watchdog_peers_must_be_positive(monkeypatch, value):
    monkeypatch.setenv("AP_WATCHDOG_PEERS", value)
    me = types.SimpleNamespace(rank=0, world_size=32)
    with pytest.raises(ValueError, match=rf"AP_WATCHDOG_PEERS must be a positive integer .* got '{value}'"):
        watchdog.Watchdog._default_peers(me)
    monkeypatch.setenv("AP_WATCHDOG_PEERS", "2")
    assert watchdog.Watchdog._default_peers(me) == [1, 2]


# ---- parallel_guard around a pipeline ------------------------------------------------------------------------
@pytest.mark.parametrize("dims", [[], ["model"]])
def test_parallel_guard_around_a_pipeline_is_refused(dims):
    ids, lab = batch(0)
    with ap.simulate(world_size=4):
        s = ap.Strategy()
        s.pipeline_parallel.degree = 2
        s.data_parallel.degree = 2
        model = build("gpt")
        pipe, opt = ap.parallelize(model, paddle.optimizer.SGD(LR, parameters=model.parameters()), strategy=s)
        for call in (lambda: pipe.train_batch(paddle.to_tensor(ids), paddle.to_tensor(lab)),
                     lambda: pipe(paddle.to_tensor(ids)), lambda: pipe.eval_batch(paddle.to_tensor(ids))):
            with pytest.raises(NotImplementedError, match=re.escape(f"parallel_guard({dims!r}) around a pipeline")):
                with ap.parallel_guard(dims):
                    call()
        with ap.parallel_guard(["data"]):             # the default: what the pipeline does anyway
            loss = pipe.train_batch(paddle.to_tensor(ids), paddle.to_tensor(lab))
    one = build("gpt")
    ref = F.cross_entropy(one(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)


# ---- to_static's tp_plan -------------------------------------------------------------------------------------
SPEC = [([4, 8], "int64"), ([4, 8], "int64")]
PLAN = {"blocks.*.mlp.fc1": ap.RowWiseParallel()}


def _to_static(full=False, dp=None, tp=1):
    s = ap.Strategy()
    if full:
        s.auto_mode = "full"
    else:
        s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    with ap.simulate(world_size=4):
        model = build("gpt")
        dm = to_static(model, None, F.cross_entropy, paddle.optimizer.SGD(LR, parameters=model.parameters()), s,
                       input_spec=SPEC, tp_plan=PLAN)
        return dm.plan.graph.graph["fixed_params"]["blocks.0.mlp.fc1.weight"]


def test_to_static_tp_plan_that_would_be_ignored_is_refused():
    assert _to_static(dp=2, tp=2) == (ap.Replicate(), ap.Shard(0))      # honoured: the row-parallel weight
    with pytest.raises(ValueError, match=r"tp_plan=\{'blocks.\*.mlp.fc1'\} would be ignored \(the mesh's 'model'"):
        _to_static(dp=4, tp=1)
    with pytest.raises(ValueError, match=r"would be ignored \(auto_mode='full'"):
        _to_static(full=True)


def test_to_static_sequence_parallel_on_a_model_without_norms_is_refused():
    """to_static's sequence parallelism annotates the norms' outputs; a model without norms got nothing."""
    from dist_scripts.static_models import MLP, mse

    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree, s.sequence_parallel.enable = 2, 2, True
    with ap.simulate(world_size=4):
        model = MLP()
        with pytest.raises(NotImplementedError, match=r"sequence_parallel.enable=True .* MLP has no \*Norm sublayer"):
            to_static(model, None, mse, paddle.optimizer.SGD(LR, parameters=model.parameters()), s,
                      input_spec=[([4, 16], "float32"), ([4, 16], "float32")])


# ---- real ranks ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched():
    out, ranks = shared_launch.results(JOB)
    return pathlib.Path(out), ranks


def test_real_ranks_merge_steps_and_refuse_the_guard(launched):
    _, ranks = launched
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        m = r["merge"]
        assert m["steps"] == 2 and m["moved"] > 1e-3 and m["err"] < 1e-5, (r["rank"], m)
        assert r["plain"]["raised"] and "opt = ap.Optimizer(opt)" in r["plain"]["raised"], (r["rank"], r["plain"])
        g = r["guard"]
        assert g["raised"] and "parallel_guard([]) around a pipeline" in g["raised"], (r["rank"], g)
    ids, lab = batch(0)
    one = build("gpt")
    ref = float(F.cross_entropy(one(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean())
    losses = [r["guard"]["loss_after"] for r in ranks if r["guard"]["loss_after"] is not None]
    assert losses, ranks
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
