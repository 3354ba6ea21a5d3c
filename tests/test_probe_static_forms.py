"""ap.to_static's DistModel in paddle's usage forms, the strategy checked against a given mesh, and the paddle
config spellings of Strategy / parallelize that must be honoured or refused (never accepted and ignored)."""
import numpy as np
import paddle
import pytest

import autoparallel as ap
from dist_scripts.static_models import MLP, mse
from test_to_static import SPEC, SimSGD, mlp_batches

pytestmark = pytest.mark.sim


def _reference(batches, lr=0.01):
    paddle.seed(0)
    m = MLP()
    opt = paddle.optimizer.AdamW(lr, parameters=m.parameters())
    out = []
    for x, y in batches:
        loss = mse(m(paddle.to_tensor(x)), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        opt.clear_grad()
        out.append(float(loss))
    return out, m


def _dm(seed=0, loss=mse, opt="adamw", mesh=None, strategy=None, **kw):
    paddle.seed(seed)
    m = MLP()
    o = {"adamw": lambda: paddle.optimizer.AdamW(0.01, parameters=m.parameters()),
         "sgd": lambda: SimSGD(0.1, m.parameters()), None: lambda: None}[opt]()
    if strategy is None:
        strategy = ap.Strategy()
        strategy.data_parallel.degree = 2
    return ap.to_static(m, kw.pop("loader", None), loss, o, strategy,
                        input_spec=kw.pop("input_spec", SPEC), mesh=mesh, **kw)


def test_first_mode_is_paddles_and_a_batch_may_come_as_one_list():
    """train with a loss and an optimizer, eval with a loss only (nothing updated), predict with neither; a
    list / tuple of fields is the fields; values are one process's."""
    batches = mlp_batches(2)
    ref, _ = _reference(batches)
    x, y = batches[0]
    with ap.simulate(world_size=2):
        dm = _dm()
        assert dm.mode == "train"
        got = [float(dm([paddle.to_tensor(x), paddle.to_tensor(y)])), float(dm(tuple(batches[1])))]
        with pytest.raises(TypeError, match="got a dict"):
            dm({"x": x, "y": y})
        with pytest.raises(ValueError, match=r"got \[4, 16\] float32; the graph is captured at one batch size"):
            dm(x[:4], y[:4])                                     # a loader's last partial batch
        evaluator = _dm(opt=None)
        assert evaluator.mode == "eval"
        assert float(evaluator(x, y)) == float(evaluator(x, y)) == pytest.approx(ref[0], rel=1e-6)
        predictor = _dm(loss=None, opt=None, input_spec=SPEC[:1])
        assert predictor.mode == "predict"
        np.testing.assert_allclose(predictor(x).full().numpy(), evaluator.predict(x).full().numpy(), rtol=1e-6)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


class _Pairs(paddle.io.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        return rng.standard_normal(16).astype("float32"), rng.standard_normal(16).astype("float32")


def test_without_a_loss_a_loaders_label_is_not_fed_to_the_model():
    """paddle splits a loader item into (inputs, labels): with no loss the model takes the inputs only."""
    x, _ = next(iter(paddle.io.DataLoader(_Pairs(), batch_size=8)))
    paddle.seed(0)
    want = MLP()(x).numpy()
    with ap.simulate(world_size=2):
        dm = _dm(loss=None, opt=None, input_spec=None, loader=paddle.io.DataLoader(_Pairs(), batch_size=8))
        assert dm.mode == "predict"
        np.testing.assert_allclose(dm(x).full().numpy(), want, rtol=1e-5, atol=1e-6)


def test_state_dict_modes_and_set_state_dict_restore_model_and_optimizer():
    """state_dict('all') = 'param' + 'opt' ("<param>.<state>"); set_state_dict on a differently initialised
    model continues the run exactly; restoring only the parameters (fresh AdamW moments) does not."""
    batches = mlp_batches(4)
    ref, _ = _reference(batches)
    with ap.simulate(world_size=2):
        dm = _dm()
        for x, y in batches[:2]:
            dm(x, y)
        params, opt, everything = dm.state_dict("param"), dm.state_dict(mode="opt"), dm.state_dict("all")
        assert set(everything) == set(params) | set(opt) and "fc1.weight.moment1" in opt
        saved = {k: v.full().numpy() if hasattr(v, "full") else v.numpy() for k, v in everything.items()}
        runs = {}
        for what in ("all", "param"):
            other = _dm(seed=1)
            other.set_state_dict({k: v for k, v in saved.items() if what == "all" or k in params})
            runs[what] = [float(other(x, y)) for x, y in batches[2:]]
        with pytest.raises(KeyError, match="fc9.weight"):
            other.set_state_dict({"fc9.weight": saved["fc1.weight"]})
        with pytest.raises(ValueError, match="expected global shape"):
            other.set_state_dict({"fc1.weight": saved["fc1.weight"][:3]})
    np.testing.assert_allclose(runs["all"], ref[2:], rtol=1e-5, atol=1e-6)
    assert runs["param"][0] == pytest.approx(ref[2], rel=1e-5) and abs(runs["param"][1] - ref[3]) > 1e-4


def test_program_accessors_refused_and_set_state_dict_with_a_custom_optimizer():
    with ap.simulate(world_size=2):
        dm = _dm(opt="sgd")
        other = _dm(seed=1, opt="sgd")                 # an optimizer with no paddle states: the model's entries
        other.set_state_dict(dm.state_dict(True))
        assert all(np.array_equal(v, other.state_dict(True)[k]) for k, v in dm.state_dict(True).items())
        for name in ("dist_main_program", "dist_startup_program", "serial_main_program", "serial_startup_program"):
            with pytest.raises(NotImplementedError, match="dist_model.graph"):
                getattr(dm, name)()


def _strategy(stmt):
    s = ap.Strategy()
    exec(stmt, {}, {"s": s})
    return s


@pytest.mark.parametrize("stmt, words", [
    ("s.data_parallel.degree = 4", "data_parallel.degree=4 but the mesh's 'data' dim has size 2"),
    ("s.tensor_parallel.degree = 2", "tensor_parallel.degree=2 but the mesh's 'model' dim has size 1"),
    ("s.sequence_parallel.enable = True", "needs tensor_parallel.degree > 1"),
    ("s.sharding.stage = 2", "sharding.stage=2 is set but sharding.enable=False"),
    ("s.recompute.granularity = 'selective'", "recompute.enable=False"),
])
def test_a_given_mesh_is_checked_against_the_strategy(stmt, words):
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([[0], [1]], dim_names=["data", "model"])
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            _dm(opt="sgd", mesh=mesh, strategy=_strategy(stmt))
        assert _dm(opt="sgd", mesh=mesh, strategy=_strategy("s.data_parallel.degree = 2")).mesh is mesh  # control


def test_sharding_needs_a_data_dim_and_full_mode_refuses_fixed_degrees():
    with ap.simulate(world_size=2):
        with pytest.raises(ValueError, match="'data' dim"):
            _dm(mesh=ap.ProcessMesh([0, 1], dim_names=["model"]), strategy=_strategy("s.sharding.enable = True"))
        with pytest.raises(ValueError, match="auto_mode='full'.*data_parallel.degree=2"):
            _dm(opt="sgd", strategy=_strategy("s.auto_mode = 'full'; s.data_parallel.degree = 2"))


@pytest.mark.parametrize("config, exc, words", [
    ({"shardng": {}}, ValueError, "unknown section 'shardng'"),
    ({"amp": {"dtype": "bfloat16"}}, ValueError, "amp.dtype='bfloat16' is set but amp.enable is not True"),
    ({"amp": {"enable": False, "init_loss_scaling": 1024.0}}, ValueError, "amp.init_loss_scaling"),
])
def test_paddle_config_sections_that_would_do_nothing_are_refused(config, exc, words):
    with pytest.raises(exc, match=words):
        ap.Strategy(config)


def test_paddle_config_defaults_restated_are_accepted():
    """Every section of paddle's default config written out (sharding.degree 8, pipeline.micro_batch_size 1,
    float16 AMP settings, ...) sets nothing: the Strategy is the default one and validates."""
    import paddle.distributed as dist

    config = {k.lstrip("_"): v for k, v in dist.Strategy().to_dict().items()}
    s = ap.Strategy(config)
    assert s.to_dict() == ap.Strategy().to_dict() and s.validate(world_size=2).dp == 2
    assert ap.Strategy({"amp": {"enable": False, "level": "O1", "init_loss_scaling": 32768}}).to_dict() == \
        ap.Strategy().to_dict()
    with pytest.raises(ValueError, match="sharding.degree=4 is set but sharding.enable=False"):    # not a default
        ap.Strategy({"sharding": {"enable": False, "degree": 4}}).validate(world_size=8)


def test_gradient_merge_k_steps_without_enable_is_refused_by_every_entry_point():
    off = ap.Strategy({"gradient_merge": {"k_steps": 2}})
    on = ap.Strategy({"gradient_merge": {"enable": True, "k_steps": 2}})
    assert on.gradient_accumulation_steps == 2 and off.gradient_accumulation_steps == 1
    with ap.simulate(world_size=2):
        with pytest.raises(ValueError, match="gradient_merge.k_steps=2 is set but gradient_merge.enable"):
            _dm(opt="sgd", strategy=off)
        paddle.seed(0)
        with pytest.raises(ValueError, match="gradient_merge.k_steps=2"):
            ap.DataParallel(MLP(), strategy=off.copy())
        assert _dm(opt="sgd", strategy=on)._k == 2


def test_parallelize_sharding_level_as_paddle_spells_it():
    from autoparallel.api_parallelize import strategy_from_config

    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    for given, stage in ((2, 2), ("2", 2), ("3", 3), ("0", None), (None, None)):
        s, _, _ = strategy_from_config({"dp_config": {"sharding_level": given}}, mesh)
        assert (s.sharding.stage if s.sharding.enable else None) == stage, given
    for bad in ("4", [2], 2.0, True):
        with pytest.raises(ValueError, match="sharding_level"):
            strategy_from_config({"dp_config": {"sharding_level": bad}}, mesh)


@pytest.mark.parametrize("style", ["SequenceParallelBegin", "SequenceParallelEnd", "SequenceParallelDisable"])
def test_a_sequence_parallel_plan_key_matching_no_layer_is_refused(style):
    import paddle.distributed as dist

    from autoparallel.parallel.tensor_parallel import PlanError
    from autoparallel.testing.models import adamw, build

    plan = {"blocks.*.attn.qkv": dist.ColWiseParallel(), "blocks.*.attn.proj": dist.RowWiseParallel()}
    with ap.simulate(world_size=2):
        m = build("gpt")
        with pytest.raises(PlanError, match=f"'wtee' \\({style}\\) matches no layer of GPT"):
            ap.parallelize(m, adamw(m.parameters()), dist.ProcessMesh([[0, 1]], ["dp", "mp"]),
                           {"mp_config": {"parallelize_plan": {**plan, "wtee": getattr(dist, style)()}}})


def test_zero3_state_dict_all_saved_and_loaded_continues_the_run(tmp_path):
    """Under ZeRO stage 3 state_dict() / state_dict('all') hold the optimizer's checkpoint leaves (the live
    parameters hold no data between steps): ap.save_state_dict and ap.load_state_dict into another run give its
    parameters / continue it exactly; set_state_dict refuses those entries by name."""
    batches = mlp_batches(4)
    ref, _ = _reference(batches)
    s = _strategy("s.data_parallel.degree = 2; s.sharding.enable = True; s.sharding.stage = 3")
    with ap.simulate(world_size=2):
        dm = _dm(strategy=s)
        got = [float(dm(x, y)) for x, y in batches[:2]]
        ap.save_state_dict(dm.state_dict("all"), str(tmp_path / "ck"))
        ap.save_state_dict(dm.state_dict(), str(tmp_path / "params"))     # released parameters: the leaves
        third = _dm(seed=2, strategy=s)
        ap.load_state_dict(third.state_dict("param"), str(tmp_path / "params"))
        want, have = dm.state_dict(True), third.state_dict(True)
        assert all(np.array_equal(want[k], have[k]) for k in want) and set(want) == set(have)
        other = _dm(seed=1, strategy=s)
        ap.load_state_dict(other.state_dict("all"), str(tmp_path / "ck"))
        got += [float(other(x, y)) for x, y in batches[2:]]
        with pytest.raises(NotImplementedError, match="'fc1.weight'.*ap.load_state_dict"):
            other.set_state_dict({"fc1.weight": np.zeros([16, 64], "float32")})
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_paddles_input_spec_pair_of_inputs_and_labels():
    """paddle's ``input_spec=[inputs_spec, labels_spec]`` is the flat list of fields; without a loss the labels
    are not fed. Values are the flat form's."""
    from paddle.static import InputSpec

    x, y = mlp_batches(1)[0]
    pair = [[InputSpec([8, 16], "float32")], [InputSpec([8, 16], "float32")]]
    with ap.simulate(world_size=2):
        assert float(_dm(opt="sgd", input_spec=pair)(x, y)) == float(_dm(opt="sgd")(x, y))
        predictor = _dm(loss=None, opt=None, input_spec=pair)
        assert predictor.mode == "predict" and list(predictor(x).shape) == [8, 16]


def test_saving_zero3_released_parameters_is_refused(tmp_path):
    """Eager ZeRO-3: model.state_dict() holds parameters released between steps; saving them would write no data
    (a later load gave wrong values), so the save names the entry and ap.training_state."""
    s = _strategy("s.data_parallel.degree = 2; s.sharding.enable = True; s.sharding.stage = 3")
    x, y = mlp_batches(1)[0]
    with ap.simulate(world_size=2):
        paddle.seed(0)
        m = MLP()
        m, opt = ap.parallelize(m, paddle.optimizer.AdamW(0.01, parameters=m.parameters()), strategy=s)
        mse(m(paddle.to_tensor(x)), paddle.to_tensor(y)).backward()
        opt.step()
        with pytest.raises(ValueError, match="'fc1.weight' holds no data.*ap.training_state"):
            ap.save_state_dict(m.state_dict(), str(tmp_path / "released"))
        ap.save_state_dict(ap.training_state(m, opt), str(tmp_path / "whole"))            # control
