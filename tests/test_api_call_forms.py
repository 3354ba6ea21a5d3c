"""Every call form of the public API paddle accepts is honoured (equal to the canonical call) or refused (a
typed error naming the argument and the value): placements, meshes, tensor entry points, shard_layer, TP
styles, paddle's parallelize(model, opt, mesh, config), Strategy in paddle's forms, shard_dataloader,
shard_scaler, to_static keywords. The table is docs/api_call_forms.md."""
import numpy as np
import paddle
import paddle.distributed as dist
import pytest

import autoparallel as ap
from autoparallel import layer_state
from autoparallel.config.paddle_compat import PADDLE_ONLY
from autoparallel.testing.check import check_every_rank
from autoparallel.testing.models import adamw, build, train_steps, trained_reference

FULL = np.arange(24, dtype="float32").reshape(4, 6)


def _same_locals(a, b):
    assert a.mesh == b.mesh and a.placements == b.placements and a.shape == b.shape
    for r in a.mesh.process_ids:
        np.testing.assert_array_equal(a.local_of(r).numpy(), b.local_of(r).numpy())


@pytest.fixture
def world4():
    with ap.simulate(world_size=4):
        yield ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])


# ---- placements --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", [
    lambda: [dist.Shard(0), dist.Shard(1)],                 # paddle's own placement objects
    lambda: [dist.Shard(0), ap.Shard(1)],                   # mixed
    lambda: (ap.Shard(0), ap.Shard(1)),                     # a tuple
    lambda: [ap.Shard(-2), ap.Shard(-1)],                   # negative dims count from the end
    lambda: "S(-2),S(-1)",                                  # the string form, negative too
])
def test_placement_forms_equal_the_canonical_list(world4, form):
    t = paddle.to_tensor(FULL)
    canonical = ap.shard_tensor(t, world4, [ap.Shard(0), ap.Shard(1)])
    _same_locals(ap.shard_tensor(t, world4, form()), canonical)


def test_partial_reduce_type_spellings(world4):
    assert ap.Partial(ap.ReduceType.kRedAvg) == ap.Partial("avg")
    assert ap.Partial(dist.ReduceType.kRedMax) == ap.Partial("max")
    assert ap.Partial("SUM") == ap.Partial()
    got = ap.shard_tensor(paddle.to_tensor(FULL), world4, [dist.Partial(dist.ReduceType.kRedSum), dist.Replicate()])
    assert got.placements == [ap.Partial("sum"), ap.Replicate()]
    np.testing.assert_array_equal(got.numpy(), FULL)        # reduced back to the full value


@pytest.mark.parametrize("make, exc, words", [
    (lambda: ap.Partial(dist.ReduceType.kRedProd), NotImplementedError, ["kRedProd", "kRedSum"]),
    (lambda: ap.Partial(3), TypeError, ["reduce_type", "int 3"]),
    (lambda: ap.Shard(0, split_factor=2), NotImplementedError, ["split_factor=2", "BlockShard"]),
    (lambda: ap.Shard(0, shard_order=1), NotImplementedError, ["shard_order=1"]),
    (lambda: ap.Shard(1.0), TypeError, ["Shard(dim)", "float"]),
])
def test_placement_forms_that_are_refused(make, exc, words):
    with pytest.raises(exc) as info:
        make()
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("placements, exc, words", [
    (lambda: [dist.Shard(0, split_factor=2)], NotImplementedError, ["split_factor=2"]),
    (lambda: [ap.Shard(-3)], ValueError, ["S(-3)", "rank 2"]),
    (lambda: ap.Shard(0), TypeError, ["one per mesh dim", "S(0)"]),
])
def test_placements_refused_by_shard_tensor(world4, placements, exc, words):
    with pytest.raises(exc) as info:
        ap.shard_tensor(paddle.to_tensor(FULL), world4, placements())
    assert all(w in str(info.value) for w in words), str(info.value)


# ---- ProcessMesh ---------------------------------------------------------------------------------------------
def test_mesh_forms_equal_the_nested_list():
    canonical = ap.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["data", "model"])
    forms = [ap.ProcessMesh(mesh=np.arange(8).reshape(2, 4), dim_names=["data", "model"]),
             ap.ProcessMesh(shape=[2, 4], process_ids=range(8), dim_names=["data", "model"]),
             ap.ProcessMesh(dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["data", "model"])),
             ap.ProcessMesh(canonical)]
    assert all(f == canonical for f in forms)
    assert ap.ProcessMesh([[0, 1], [2, 3]]).dim_names == dist.ProcessMesh([[0, 1], [2, 3]]).dim_names
    assert ap.ProcessMesh([[0, 1], [2, 3]]) != canonical                       # negative control


@pytest.mark.parametrize("kwargs, words", [
    (dict(shape=[2, 4]), ["shape=", "process_ids=None"]),
    (dict(shape=[2, 3], process_ids=range(8)), ["8 ranks", "[2, 3]"]),
    (dict(mesh=[[0, 1], [2, 3]], shape=[4]), ["disagrees", "shape=[4]"]),
])
def test_mesh_forms_that_are_refused(kwargs, words):
    with pytest.raises(ValueError) as info:
        ap.ProcessMesh(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_sub_meshes_as_paddle_computes_them():
    ours = ap.ProcessMesh([[0, 1, 2], [3, 4, 5]], dim_names=["x", "y"])
    theirs = dist.ProcessMesh([[0, 1, 2], [3, 4, 5]], dim_names=["x", "y"])
    for args in (("y",), ("y", 1), ("x", 0)):
        a, b = ours.get_mesh_with_dim(*args), theirs.get_mesh_with_dim(*args)
        assert (a.process_ids, a.dim_names, a.shape) == (b.process_ids, b.dim_names, b.shape), args
    for name in ("x", "y"):                   # through this process's rank (0 here, as paddle's get_rank())
        a, b = ours.get_submesh_with_dim(name), theirs.get_submesh_with_dim(name)
        assert (a.process_ids, a.dim_names) == (b.process_ids, b.dim_names), name
    assert ours.get_submesh_with_dim("x", 1).process_ids == [3, 4, 5]          # this project's index form
    assert ours.dim_size("y") == 3
    with pytest.raises(ValueError, match="needs the dim name"):
        ours.get_group()
    with ap.simulate(world_size=6), pytest.raises(RuntimeError, match="simulated world.*no paddle process groups"):
        ours.get_group("x")


def test_a_paddle_mesh_is_accepted_everywhere_a_mesh_is(world4):
    pm = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    t = paddle.to_tensor(FULL)
    a = ap.shard_tensor(t, pm, [ap.Shard(0), ap.Replicate()])
    _same_locals(a, ap.shard_tensor(t, world4, [ap.Shard(0), ap.Replicate()]))
    _same_locals(ap.reshard(a, pm, [ap.Replicate(), ap.Shard(1)]),
                 ap.shard_tensor(t, world4, [ap.Replicate(), ap.Shard(1)]))
    assert ap.ShardingStage1("x", pm).mesh == world4
    from autoparallel.parallel.sharding_stages import resolve_shard_fn
    assert resolve_shard_fn(None, pm).mesh == world4                           # shard_optimizer(opt, mesh)


# ---- tensor entry points -------------------------------------------------------------------------------------
def test_shard_tensor_positional_and_keyword_forms(world4):
    t = paddle.to_tensor(FULL)
    canonical = ap.shard_tensor(t, world4, [ap.Shard(0), ap.Replicate()])
    positional = ap.shard_tensor(t, world4, [ap.Shard(0), ap.Replicate()], None, paddle.CPUPlace(), True)
    keyword = ap.shard_tensor(data=t, mesh=world4, placements=[ap.Shard(0)], dtype="float32", place="cpu",
                              stop_gradient=False)
    _same_locals(positional, canonical)
    _same_locals(keyword, canonical)                          # a short placement list is padded with R
    assert positional.stop_gradient and not keyword.stop_gradient
    _same_locals(ap.shard_tensor(FULL.tolist(), world4, [ap.Shard(0)], "float32", "cpu"), canonical)
    with pytest.raises(ValueError, match="place='xpu:3'"):
        ap.shard_tensor(t, world4, [ap.Shard(0)], place="xpu:3")
    with pytest.raises(TypeError, match="stop_gradient.*'yes'"):
        ap.shard_tensor(t, world4, [ap.Shard(0)], None, None, "yes")


def test_reshard_and_local_helpers_in_paddle_forms(world4):
    t = paddle.to_tensor(FULL)
    a = ap.shard_tensor(t, world4, [ap.Shard(0), ap.Shard(1)])
    _same_locals(ap.reshard(dist_tensor=a, mesh=world4, placements=[ap.Replicate(), ap.Shard(-1)]),
                 ap.reshard(a, world4, [ap.Replicate(), ap.Shard(1)]))
    shards = [a.local_of(r) for r in world4.process_ids]
    _same_locals(ap.dtensor_from_local(local_tensor=shards, mesh=world4, placements=[dist.Shard(-2), dist.Shard(-1)]),
                 a)
    _same_locals(ap.dtensor_from_local(local=shards, mesh=world4, placements=[ap.Shard(0), ap.Shard(1)]), a)
    with pytest.raises(TypeError, match="local_tensor= and local= are the same argument"):
        ap.dtensor_from_local(shards, world4, [ap.Shard(0)], local=shards)
    assert a.process_mesh == world4 and a.is_dist() and a._local_value() is a.local
    np.testing.assert_array_equal(ap.unshard_dtensor(a).numpy(), FULL)
    np.testing.assert_array_equal(ap.dtensor_to_local(a, world4, [ap.Shard(0), ap.Shard(1)]).numpy(), FULL[:2, :3])
    _same_locals(ap.dtensor_from_fn(paddle.ones, world4, [ap.Shard(0)], [4, 6]),
                 ap.shard_tensor(paddle.ones([4, 6]), world4, [ap.Shard(0)]))
    with pytest.raises(ValueError, match=r"placements \[R, S\(1\)\] are not the tensor's \[S\(0\), S\(1\)\]"):
        ap.dtensor_to_local(a, world4, [ap.Replicate(), ap.Shard(1)])
    with pytest.raises(TypeError, match="dtensor_from_local expects a ProcessMesh, got list"):
        ap.dtensor_from_local(shards, [0, 1, 2, 3], [ap.Shard(0)])


# ---- shard_layer ----------------------------------------------------------------------------------------------
def _shard_fn(name, layer, mesh):
    if name == "0":
        layer.weight = ap.shard_tensor(layer.weight, mesh, [dist.Shard(-1)])


def _layer_output(**kwargs):
    paddle.seed(0)
    net = paddle.nn.Sequential(paddle.nn.Linear(6, 4), paddle.nn.ReLU(), paddle.nn.Linear(4, 2))
    net = ap.shard_layer(net, **kwargs)
    return net, net(paddle.to_tensor(FULL)).numpy()


def test_shard_layer_keyword_forms():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], ["x"])
        paddle.seed(0)
        ref = paddle.nn.Sequential(paddle.nn.Linear(6, 4), paddle.nn.ReLU(), paddle.nn.Linear(4, 2))
        want = ref(paddle.to_tensor(FULL)).numpy()
        for kwargs in (dict(layer=None, process_mesh=mesh, shard_fn=_shard_fn), dict(layer=None, mesh=mesh,
                       shard_fn=_shard_fn), dict(layer=None, process_mesh=dist.ProcessMesh([0, 1], ["x"]),
                       shard_fn=_shard_fn)):
            kwargs.pop("layer")
            net, got = _layer_output(**kwargs)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            assert net[0].weight.placements == [ap.Shard(1)]
        with pytest.raises(TypeError, match="process_mesh= and mesh= are the same argument"):
            _layer_output(process_mesh=mesh, mesh=mesh)


# ---- tensor-parallel styles: paddle's positional order ---------------------------------------------------------
def test_tp_styles_take_paddles_positional_arguments():
    assert ap.ColWiseParallel(True) == ap.ColWiseParallel(gather_output=True)
    assert ap.RowWiseParallel(False) == ap.RowWiseParallel(is_input_parallel=False)
    assert ap.RowWiseParallel(False) != ap.RowWiseParallel()                   # negative control
    with pytest.raises(TypeError):
        ap.ColWiseParallel(False, True)                     # sequence_parallel is keyword-only
    with pytest.raises(TypeError, match="is_input_parallel=.*'no'"):
        ap.RowWiseParallel("no")


@pytest.mark.parametrize("row", [ap.RowWiseParallel(), ap.RowWiseParallel(False), ap.RowWiseParallel(True)])
def test_row_wise_is_input_parallel_values_compute_the_reference(row):
    ref_losses, ref_params = trained_reference("gpt", 2)
    with ap.simulate(world_size=2):
        s = ap.Strategy()
        s.tensor_parallel.degree = 2
        m = build("gpt")
        plan = {"blocks.*.mlp.fc1": ap.ColWiseParallel(False), "blocks.*.mlp.fc2": row}
        m, opt = ap.parallelize(m, adamw(m.parameters()), strategy=s, tp_plan=plan)
        np.testing.assert_allclose(train_steps(m, opt, 2), ref_losses, rtol=1e-5, atol=1e-6)
        check_every_rank(m, ref_params)
        fc2 = dict(m.named_sublayers())["blocks.0.mlp.fc2"]
        assert fc2.weight.placements == [ap.Replicate(), ap.Shard(0)]


# ---- parallelize(model, optimizer, mesh, config): paddle's intermediate API ---------------------------------------
PLAN = {"blocks.*.mlp.fc1": ap.ColWiseParallel(), "blocks.*.mlp.fc2": ap.RowWiseParallel()}


def _paddle_form_run(form):
    m = build("gpt")
    opt = adamw(m.parameters())
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    config = {"dp_config": {"sharding_level": 1}, "mp_config": {"parallelize_plan": dict(PLAN)}}
    if form == "paddle positional":
        m, opt = ap.parallelize(m, opt, mesh, config)
    elif form == "paddle keywords":
        m, opt = ap.parallelize(model=m, optimizer=opt, mesh=mesh, config=config)
    else:
        s = ap.Strategy()
        s.data_parallel.degree, s.tensor_parallel.degree = 2, 2
        s.sharding.enable, s.sharding.stage = True, 1
        m, opt = ap.parallelize(m, opt, strategy=s, tp_plan=dict(PLAN))
    return m, opt


def test_parallelize_plan_in_paddles_spellings_equals_ours():
    """paddle's own ColWise/RowWiseParallel objects, a one-style list and a parameter-name key give the same
    plan as our styles on the layer name."""
    from autoparallel.api_parallelize import strategy_from_config

    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    paddle_plan = {"blocks.*.mlp.fc1.weight": dist.ColWiseParallel(gather_output=True),
                   "blocks.*.mlp.fc2": [dist.RowWiseParallel(is_input_parallel=False)]}
    _, _, got = strategy_from_config({"mp_config": {"parallelize_plan": paddle_plan}}, mesh)
    assert got == {"blocks.*.mlp.fc1": ap.ColWiseParallel(True), "blocks.*.mlp.fc2": ap.RowWiseParallel(False)}
    assert got != {"blocks.*.mlp.fc1": ap.ColWiseParallel(), "blocks.*.mlp.fc2": ap.RowWiseParallel()}


def test_parallelize_paddle_config_equals_the_strategy_form():
    """The config's dp/mp sections and the mesh's dim sizes give the same build as the Strategy form: the same
    resolved strategy and parameter layouts, and the single-process losses and parameters."""
    ref_losses, ref_params = trained_reference("gpt", 2)
    with ap.simulate(world_size=4):
        runs = {form: _paddle_form_run(form) for form in ("paddle positional", "paddle keywords", "canonical")}
        layouts = {f: {n: p.placements for n, p in m.named_parameters()} for f, (m, _) in runs.items()}
        strategies = {f: layer_state.build_of(m).strategy for f, (m, _) in runs.items()}
        assert strategies["canonical"].sharding.stage == 1 and strategies["canonical"].tensor_parallel.degree == 2
        for form, (m, opt) in runs.items():
            assert strategies[form] == strategies["canonical"], form
            assert layouts[form] == layouts["canonical"], form
            assert layouts[form]["blocks.0.mlp.fc1.weight"] == [ap.Replicate(), ap.Shard(1)]
            assert type(opt) is type(runs["canonical"][1]), form                  # the ZeRO-1 optimizer
            np.testing.assert_allclose(train_steps(m, opt, 2), ref_losses, rtol=1e-5, atol=1e-6)
            check_every_rank(m, ref_params)


@pytest.mark.parametrize("mesh, config, exc, words", [
    ([["dp", "mp"]], {"bogus": {}}, ValueError, ["unknown config key 'bogus'"]),
    ([["dp", "mp"]], {"dp_config": {"sharding_level": 4}}, ValueError, ["sharding_level", "got 4"]),
    ([["dp", "mp"]], {"dp_config": {"sharding_level": 1, "sharding_mesh_dim": "mp"}}, NotImplementedError,
     ["['sharding_mesh_dim']='mp'"]),
    ([["dp", "mp"]], {"dp_config": {"level": 1}}, ValueError, ["unknown keys ['level']"]),
    ([["dp", "mp"]], {"cp_config": {"parallelize_plan": {}}}, NotImplementedError, ["cp_config"]),
    ([["dp", "pp"]], {"pp_config": {"split_spec": {"blocks.0": "END"}}}, TypeError, ["split_spec", "SplitPoint"]),
    ([["dp", "pp"]], {"pp_config": {"split_spec": "layers"}}, NotImplementedError, ["'layers'", "'blocks'"]),
    ([["dp", "pp"]], {"pp_config": {"global_spec": "wte"}}, NotImplementedError, ["['global_spec']='wte'"]),
    ([["dp", "sep"]], {}, ValueError, ["mesh dim 'sep'"]),
    ([["dp", "mp"]], {"mp_config": {"parallelize_plan": {"blocks.*.attn": dist.ContextParallel()}}},
     NotImplementedError, ["paddle.distributed.ContextParallel"]),
    ([["dp", "mp"]], {"mp_config": {"parallelize_plan": {"blocks.*.mlp.fc1": [ap.ColWiseParallel(),
                                                                                ap.RowWiseParallel()]}}},
     NotImplementedError, ["lists 2 styles"]),
    ([["dp", "mp"]], {"mp_config": {"parallelize_plan": {"blocks.*.ln1": [ap.SequenceParallel(),
                                                                            dist.SequenceParallelEnable()]}}},
     ValueError, ["combines SequenceParallelEnable"]),
    ([["dp", "mp"]], {"mp_config": {"parallelize_plan": {"blocks.*.mlp.fc1.weight": ap.ColWiseParallel(),
                                                         "blocks.*.mlp.fc1": ap.RowWiseParallel()}}},
     ValueError, ["two styles"]),
])
def test_parallelize_paddle_config_refusals(mesh, config, exc, words):
    with ap.simulate(world_size=4):
        m = build("gpt")
        pm = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=mesh[0])
        with pytest.raises(exc) as info:
            ap.parallelize(m, adamw(m.parameters()), pm, config)
        assert all(w in str(info.value) for w in words), str(info.value)


def test_parallelize_with_only_a_mesh_takes_the_degrees_from_it():
    with ap.simulate(world_size=4):
        for mesh in (ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"]),
                     dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])):
            m = build("gpt")
            m, _ = ap.parallelize(m, None, mesh)
            s = layer_state.build_of(m).strategy
            assert (s.data_parallel.degree, s.tensor_parallel.degree) == (2, 2)
            assert dict(m.named_parameters())["blocks.0.mlp.fc1.weight"].placements == [ap.Replicate(), ap.Shard(1)]


def test_parallelize_strategy_that_disagrees_with_the_mesh_is_refused():
    with ap.simulate(world_size=4):
        s = ap.Strategy()
        s.tensor_parallel.degree = 4
        m = build("gpt")
        with pytest.raises(ValueError, match=r"disagree with the mesh.*model: strategy 4, mesh 2"):
            ap.parallelize(m, adamw(m.parameters()), strategy=s,
                           mesh=ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]))


# ---- Strategy in paddle's forms ------------------------------------------------------------------------------------
def _canonical_strategy():
    s = ap.Strategy()
    s.sharding.enable, s.sharding.stage = True, 2
    s.gradient_accumulation_steps = 4
    s.pipeline_parallel.degree, s.pipeline_parallel.schedule, s.pipeline_parallel.micro_batches = 2, "FThenB", 4
    s.amp.enable, s.amp.level = True, "O2"
    return s


def test_strategy_paddle_config_dict_attributes_and_object_equal_the_canonical():
    config = {"sharding": {"enable": True, "stage": 2, "enable_overlap": False},
              "gradient_merge": {"enable": True, "k_steps": 4, "avg": True},
              "pipeline": {"enable": True, "pp_degree": 2, "schedule_mode": "FThenB", "accumulate_steps": 4},
              "amp": {"enable": True, "dtype": "bfloat16", "level": "o2"}}
    attrs = ap.Strategy()
    attrs.sharding.enable = True; attrs.sharding.stage = 2
    attrs.gradient_merge.enable = True; attrs.gradient_merge.k_steps = 4
    attrs.pipeline.enable = True; attrs.pipeline.pp_degree = 2; attrs.pipeline.schedule_mode = "FThenB"
    attrs.pipeline.accumulate_steps = 4
    attrs.amp.enable = True; attrs.amp.level = "o2"
    ps = dist.Strategy()
    ps.sharding.enable = True; ps.sharding.stage = 2
    ps.gradient_merge.enable = True; ps.gradient_merge.k_steps = 4
    ps.pipeline.enable = True; ps.pipeline.pp_degree = 2; ps.pipeline.schedule_mode = "FThenB"
    ps.pipeline.accumulate_steps = 4
    ps.amp.enable = True; ps.amp.dtype = "bfloat16"; ps.amp.level = "o2"
    from autoparallel.api_strategy import from_paddle_strategy
    canonical = _canonical_strategy()
    assert ap.Strategy(config) == canonical and ap.Strategy(config=config) == canonical
    assert attrs == canonical and from_paddle_strategy(ps) == canonical
    assert ap.Strategy({"gradient_merge": {"enable": True, "k_steps": 2}}) != canonical       # negative control
    assert attrs.pipeline.schedule_mode == "FThenB" and attrs.gradient_merge.k_steps == 4
    assert attrs.sharding.enable_tensor_fusion is False                # a paddle-only field reads as its default


def test_a_paddle_amp_section_takes_paddles_defaults():
    s = ap.Strategy({"amp": {"enable": True}})
    assert (s.amp.dtype, s.amp.init_loss_scaling, s.amp.incr_every_n_steps, s.amp.decr_every_n_nan_or_inf,
            s.amp.decr_ratio) == ("float16", 32768.0, 1000, 2, 0.8)
    assert ap.Strategy({"amp": {"enable": True, "dtype": "bfloat16"}}).amp.init_loss_scaling == 65536.0


def test_gradient_merge_and_pipeline_views_map_both_ways():
    s = ap.Strategy()
    s.gradient_merge.k_steps = 3
    assert s.gradient_accumulation_steps == 1                    # k_steps acts only once enabled, as in paddle
    s.gradient_merge.enable = True
    assert s.gradient_accumulation_steps == 3
    s.gradient_merge.enable = False
    assert s.gradient_accumulation_steps == 1
    s.pipeline.schedule_mode = "ZBH1"
    assert s.pipeline_parallel.schedule == "ZB-H1" and s.pipeline.schedule_mode == "ZBH1"
    s2 = ap.Strategy()
    s2.pipeline.enable = True
    for each in (s2, s2.copy()):                     # the flag survives a copy
        with pytest.raises(ValueError, match="pipeline.enable=True needs the number of stages"):
            each.validate(world_size=2)


@pytest.mark.parametrize("section, name", [(sec, n) for sec, fields in PADDLE_ONLY.items() for n in fields])
def test_every_paddle_only_field_accepts_its_default_and_refuses_another_value(section, name):
    s = ap.Strategy()
    default = PADDLE_ONLY[section][name]
    other = (not default) if isinstance(default, bool) else ([1] if isinstance(default, list) else
                                                              "x" if isinstance(default, str) else default + 7)
    if section in ("Strategy", "sharding", "amp", "pipeline", "fused_passes", "recompute"):
        target = s if section == "Strategy" else getattr(s, section)
        setattr(target, name, default)                           # accepted: paddle's default is what runs here
        assert s == ap.Strategy()
        with pytest.raises(NotImplementedError) as info:
            setattr(target, name, other)
    else:
        assert ap.Strategy({section: {name: default}}) == ap.Strategy()
        with pytest.raises(NotImplementedError) as info:
            ap.Strategy({section: {name: other}})
    assert f"{name}={other!r}" in str(info.value) and "not supported" in str(info.value)


@pytest.mark.parametrize("stmt, exc, words", [
    ("s.gradient_merge.avg = False", NotImplementedError, ["avg=False"]),
    ("s.pipeline.schedule_mode = 'Eager1F1B'", NotImplementedError, ["'Eager1F1B'"]),
    ("s.pipeline.bogus = 1", AttributeError, ["pipeline has no field 'bogus'"]),
    ("s.amp.level = 'o3'", ValueError, ["amp.level", "'o3'"]),
    ("ap.Strategy('semi')", ValueError, ["expects a dict", "'semi'"]),
    ("ap.Strategy(auto_mod='semi')", TypeError, ["auto_mod"]),
    ("ap.Strategy({'tuning': {'enable': True}})", ValueError, ["unknown section 'tuning'"]),
])
def test_strategy_forms_that_are_refused(stmt, exc, words):
    s = ap.Strategy()
    with pytest.raises(exc) as info:
        exec(stmt, {"s": s, "ap": ap})
    assert all(w in str(info.value) for w in words), str(info.value)


# ---- shard_dataloader, shard_scaler, to_static keywords, names ------------------------------------------------
class _Pairs(paddle.io.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.full([3], i, "float32"), np.array([i], "int64")


class _Dicts(_Pairs):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return {"x": x, "y": y}


def test_shard_dataloader_lays_out_the_global_batch(world4):
    loader = paddle.io.DataLoader(_Pairs(), batch_size=4, shuffle=False)
    sharded = ap.shard_dataloader(loader, meshes=dist.ProcessMesh([[0, 1], [2, 3]], ["x", "y"]), shard_dims="x")
    assert len(sharded) == len(loader) == 2
    for (x, y), (gx, gy) in zip(sharded, loader):
        assert x.placements == [ap.Shard(0), ap.Replicate()] and y.placements == [ap.Shard(0), ap.Replicate()]
        np.testing.assert_array_equal(x.numpy(), gx.numpy())
        np.testing.assert_array_equal(y.numpy(), gy.numpy())
    x, y = next(iter(ap.shard_dataloader(loader, world4, shard_dims=1, dense_tensor_idx=[[], [0]])))
    assert x.placements == [ap.Replicate(), ap.Shard(0)] and isinstance(y, paddle.Tensor)
    batch = next(ap.shard_dataloader(paddle.io.DataLoader(_Dicts(), batch_size=4), world4, input_keys=["x"],
                                     shard_dims="y")())
    assert batch["x"].placements == [ap.Replicate(), ap.Shard(0)] and isinstance(batch["y"], paddle.Tensor)
    rep = next(iter(ap.shard_dataloader(loader, world4)))[0]
    assert rep.placements == [ap.Replicate(), ap.Replicate()]


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(is_dataset_splitted=True), ValueError, ["shard_dims must be set"]),
    (dict(shard_dims="z"), ValueError, ["'z'"]),
    (dict(shard_dims=["x", "y"]), ValueError, ["one per mesh"]),
    (dict(is_dataset_splitted=1, shard_dims="x"), TypeError, ["is_dataset_splitted"]),
])
def test_shard_dataloader_refusals(world4, kwargs, exc, words):
    loader = paddle.io.DataLoader(_Pairs(), batch_size=4)
    with pytest.raises(exc) as info:
        ap.shard_dataloader(loader, world4, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_shard_scaler_returns_the_distributed_aware_scaler():
    scaler = paddle.amp.GradScaler(init_loss_scaling=1024)
    assert ap.shard_scaler(scaler) is scaler
    with pytest.raises(TypeError, match="GradScaler, got int"):
        ap.shard_scaler(3)


def test_to_static_paddle_keywords_reach_the_same_arguments(monkeypatch):
    import autoparallel.graph.to_static as ts

    seen = []
    monkeypatch.setattr(ts, "to_static", lambda *a, **k: seen.append((a, k)))
    net, loss = paddle.nn.Linear(2, 2), paddle.nn.MSELoss()
    ap.to_static(layer=net, loss=loss, input_spec=[1])
    ap.to_static(model=net, loss_fn=loss, input_spec=[1])
    ap.to_static(net, None, loss, None, None, [1])
    assert seen[0] == seen[1] == seen[2] == ((net, None, loss, None, None, [1]), {})
    ps = dist.Strategy()
    ps.gradient_merge.enable, ps.gradient_merge.k_steps = True, 2
    ap.to_static(net, None, loss, strategy=ps, input_spec=[1])
    assert seen[3][0][4].gradient_accumulation_steps == 2           # paddle's Strategy converted
    with pytest.raises(TypeError, match="loss= and loss_fn= are the same argument"):
        ap.to_static(net, loss=loss, loss_fn=loss)
    piped = ap.Strategy()
    piped.pipeline.enable = True
    with pytest.raises(NotImplementedError, match="to_static cannot honour strategy.pipeline.enable=True"):
        ap.to_static(net, None, loss, strategy=piped, input_spec=[1], mesh=ap.ProcessMesh([0]))


@pytest.mark.parametrize("name", ["SequenceParallelBegin", "SequenceParallelDisable", "set_mesh",
                                  "enable_auto_dp", "shard_op", "ConvParallel", "build_sharded_state_dict"])
def test_paddle_names_not_provided_say_what_to_use(name):
    """Auto-parallel names among them point to what works here: paddle's own act on paddle's distributed tensors
    (``enable_auto_dp`` pointed to paddle itself, whose flag never reaches these tensors)."""
    with pytest.raises(AttributeError, match=f"does not provide paddle.distributed.{name}: "):
        getattr(ap, name)


def test_other_paddle_distributed_names_point_to_paddle():
    with pytest.raises(AttributeError, match="not re-exported here; call paddle.distributed.barrier itself"):
        ap.barrier
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        ap.no_such_name


def test_environment_names():
    assert ap.get_world_size() == 1
    with ap.simulate(world_size=4):
        assert ap.get_world_size() == 4 and ap.get_rank() == 0


def test_dist_model_paddle_modes_equal_the_step_methods():
    """``dm.train(); dm(x, y)`` is train_step, ``dm.eval(); dm(x, y)`` eval_step, ``dm.predict(); dm(x)`` the
    output: two models trained the two ways stay identical."""
    from dist_scripts.static_models import MLP, mse
    from test_to_static import SPEC, SimSGD, mlp_batches

    batches = mlp_batches(2)
    with ap.simulate(world_size=2):
        dms = []
        for _ in range(2):
            paddle.seed(0)
            model = MLP()
            s = ap.Strategy()
            s.data_parallel.degree = 2
            dms.append(ap.to_static(model, None, mse, SimSGD(0.1, model.parameters()), s, input_spec=SPEC))
        canonical, paddle_form = dms
        assert paddle_form.mode == "train"
        for x, y in batches:
            want = canonical.train_step((x, y))
            got = paddle_form(paddle.to_tensor(x), paddle.to_tensor(y))
            assert isinstance(got, np.ndarray) and got.shape == () and got.dtype == np.float32   # return_numpy
            assert float(got) == pytest.approx(want, rel=1e-6)
        paddle_form.eval()
        x, y = batches[0]
        assert float(paddle_form(x, y)) == pytest.approx(canonical.eval_step((x, y)), rel=1e-6)
        assert float(paddle_form(x, y)) == pytest.approx(canonical.eval_step((x, y)), rel=1e-6)   # nothing stepped
        paddle_form.predict()
        np.testing.assert_allclose(paddle_form(x).full().numpy(), canonical.predict(x).full().numpy(), rtol=1e-6)
        with pytest.raises(TypeError, match="expects the batch fields"):
            paddle_form()
        assert set(paddle_form.state_dict("param")) == set(canonical.state_dict())
        with pytest.raises(TypeError, match="states of a paddle optimizer"):      # SimSGD keeps no states
            paddle_form.state_dict("all")
        with pytest.raises(NotImplementedError, match="split_fusion=False"):
            paddle_form.state_dict(split_fusion=False)


def test_placements_compare_equal_to_paddles_own():
    assert ap.Shard(0) == dist.Shard(0) and dist.Shard(0) == ap.Shard(0)
    assert [ap.Replicate(), ap.Partial()] == [dist.Replicate(), dist.Partial(dist.ReduceType.kRedSum)]
    assert ap.Shard(1) != dist.Shard(0) and ap.Partial("max") != dist.Partial()             # negative controls
    assert ap.Shard(0) != ap.Replicate() and len({ap.Shard(0), ap.Shard(0)}) == 1
    assert ap.Shard(2).get_dim() == 2 and ap.Replicate().is_replicated() and not ap.Shard(0).is_replicated()
    assert ap.Shard(1).is_shard() and ap.Shard(1).is_shard(1) and not ap.Shard(1).is_shard(0)


class _Regression(paddle.io.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        return rng.standard_normal(16).astype("float32"), rng.standard_normal(16).astype("float32")


def test_paddles_to_static_example_flow_equals_one_process():
    """paddle's documented flow: shard_dataloader -> to_static(layer, dist_loader, loss, opt) -> train() ->
    ``dist_model(x, y)`` per batch; the losses are the single-process ones."""
    from dist_scripts.static_models import MLP, mse
    from test_to_static import SimSGD

    paddle.seed(0)
    model = MLP()
    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    want = []
    for x, y in paddle.io.DataLoader(_Regression(), batch_size=8, shuffle=False):
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        want.append(float(loss))
    with ap.simulate(world_size=2):
        paddle.seed(0)
        model = MLP()
        mesh = ap.ProcessMesh([[0], [1]], dim_names=["data", "model"])
        loader = ap.shard_dataloader(paddle.io.DataLoader(_Regression(), batch_size=8, shuffle=False), mesh,
                                     shard_dims="data")
        s = ap.Strategy()
        s.data_parallel.degree = 2
        dist_model = ap.to_static(model, loader, mse, SimSGD(0.1, model.parameters()), s)
        dist_model.train()
        got = [float(dist_model(x, y)) for x, y in loader()]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class _SquareSum(ap.LocalLayer):
    def forward(self, x):
        return (x * x).sum()


def test_local_layer_runs_on_shards_and_its_partial_output_is_the_global_value():
    """paddle's LocalLayer example: a per-rank sum declared Partial(sum) is the global sum; the gradient reaches
    every shard (the single-process gradient 2x)."""
    x_np = np.arange(8, dtype="float32").reshape(4, 2)
    with ap.simulate(world_size=2):
        mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
        x = ap.shard_tensor(paddle.to_tensor(x_np), mesh, [dist.Shard(0)], stop_gradient=False)
        layer = _SquareSum(out_dist_attrs=[(mesh, [dist.Partial(dist.ReduceType.kRedSum)])],
                           grad_dist_attrs=[(mesh, [dist.Shard(0)])])
        loss = layer(x)
        assert loss.placements == [ap.Partial()] and float(loss) == pytest.approx(float((x_np ** 2).sum()))
        loss.backward()
        np.testing.assert_allclose(x.grad.numpy(), 2 * x_np)
        wrong = _SquareSum([(mesh, [ap.Replicate()])], [None])(x)       # negative control: not summed
        assert float(wrong) != pytest.approx(float((x_np ** 2).sum()))
        with pytest.raises(NotImplementedError, match=r"grad_dist_attrs\[0\].*\[P\(sum\)\]\) differs"):
            _SquareSum([(mesh, [ap.Partial()])], [(mesh, [ap.Partial()])])(x)
        with pytest.raises(ValueError, match="1 inputs but 2 grad_dist_attrs"):
            _SquareSum([(mesh, [ap.Partial()])], [None, None])(x)


def test_local_map_checks_or_reshards_its_inputs():
    x_np = np.arange(8, dtype="float32").reshape(4, 2)
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        x = ap.shard_tensor(paddle.to_tensor(x_np), mesh, [ap.Shard(0)])
        double = ap.local_map(lambda a: a * 2, out_placements=[[ap.Shard(0)]], in_placements=[[ap.Shard(0)]])
        np.testing.assert_array_equal(double(x).numpy(), 2 * x_np)
        rep = ap.reshard(x, mesh, [ap.Replicate()])
        with pytest.raises(ValueError, match=r"input 0 is \[R\], in_placements\[0\] says \[S\(0\)\]"):
            double(rep)
        again = ap.local_map(lambda a: a * 2, [[ap.Shard(0)]], [[ap.Shard(0)]], mesh, reshard_inputs=True)
        np.testing.assert_array_equal(again(rep).numpy(), 2 * x_np)
        with pytest.raises(ValueError, match="returned 1 output"):
            ap.local_map(lambda a: a, [[ap.Shard(0)], [ap.Shard(0)]])(x)


def test_a_paddle_strategy_object_is_taken_by_every_entry_point():
    """``dist.Strategy()`` with gradient merge given to ap.DataParallel + ap.Optimizer and to ap.parallelize builds
    what the same ap.Strategy builds; a paddle field we cannot honour is refused there."""
    ps = dist.Strategy()
    ps.gradient_merge.enable, ps.gradient_merge.k_steps = True, 2
    with ap.simulate(world_size=2):
        m = build("gpt")
        opt = adamw(m.parameters())
        m = ap.DataParallel(m, strategy=ps)
        ap.Optimizer(opt, strategy=ps)
        assert layer_state.build_of(m).strategy.gradient_accumulation_steps == 2
        m2 = build("gpt")
        m2, _ = ap.parallelize(m2, adamw(m2.parameters()), strategy=ps)
        assert layer_state.build_of(m2).strategy == layer_state.build_of(m).strategy
        ps.fused_passes.gemm_epilogue = True
        with pytest.raises(NotImplementedError, match="fused_passes.gemm_epilogue=True"):
            ap.DataParallel(build("gpt"), strategy=ps)


def _mlp():
    paddle.seed(0)
    return paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.GELU(), paddle.nn.Linear(16, 8))


def _mse(a, b):
    return ((a - b) ** 2).mean()


class _Regression8(paddle.io.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        return rng.standard_normal(8).astype("float32"), rng.standard_normal(8).astype("float32")


def test_paddles_dygraph_semi_auto_flow_in_its_own_forms_equals_one_process():
    """paddle's documented dygraph flow, written with paddle's objects: a ``dist.ProcessMesh`` named dp/mp,
    ``shard_layer(process_mesh=...)`` with a shard_fn placing ``dist.Shard``/``dist.Replicate``,
    ``shard_optimizer(opt, ShardingStage2("dp", mesh))``, ``shard_dataloader(meshes=, shard_dims="dp")`` and its
    ``loader()`` call; losses and every rank's parameters equal one process."""
    model = _mlp()
    opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
    want = []
    for x, y in paddle.io.DataLoader(_Regression8(), batch_size=8, shuffle=False):
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        want.append(float(loss))
    ref_params = {n: p.numpy() for n, p in model.named_parameters()}

    def shard_fn(name, layer, process_mesh):
        if name == "0":
            layer.weight = ap.shard_tensor(layer.weight, process_mesh, [dist.Replicate(), dist.Shard(1)])
            layer.bias = ap.shard_tensor(layer.bias, process_mesh, [dist.Replicate(), dist.Shard(0)])
        elif name == "2":
            layer.weight = ap.shard_tensor(layer.weight, process_mesh, [dist.Replicate(), dist.Shard(0)])

    with ap.simulate(world_size=4):
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        model = ap.shard_layer(_mlp(), process_mesh=mesh, shard_fn=shard_fn)
        opt = ap.shard_optimizer(paddle.optimizer.AdamW(1e-2, parameters=model.parameters()),
                                 ap.ShardingStage2("dp", mesh))
        loader = ap.shard_dataloader(paddle.io.DataLoader(_Regression8(), batch_size=8, shuffle=False), meshes=mesh,
                                     shard_dims="dp")
        got = []
        for x, y in loader():
            loss = _mse(model(x), y)
            loss.backward()
            opt.step()
            opt.clear_grad()
            got.append(float(loss))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert check_every_rank(model, ref_params) == 4 * len(ref_params)
        assert model[0].weight.placements == [dist.Replicate(), dist.Shard(1)]


def _gather_output(process_mesh):
    def hook(layer, inputs, output):
        seen.append(("out", list(output.placements)))
        return ap.reshard(output, process_mesh, [ap.Replicate()] * process_mesh.ndim)
    return hook


def _note_output(process_mesh):
    def hook(layer, inputs, output):
        seen.append(("after", list(output.placements)))
    return hook


def _note_input(process_mesh):
    def hook(layer, inputs):
        seen.append(("in", process_mesh.dim_names))
    return hook


seen = []


@pytest.mark.parametrize("form", ["ours", "paddle config"])
def test_prepare_layer_hooks_run_after_the_build(form):
    """PrepareLayerInput/Output (ours or paddle's objects, in a plan list next to a TP style): the hook gets the
    model's mesh, runs after the style's own hooks (it sees the column-parallel output S(1)), and its reshard
    takes effect; the loss is the single-process one."""
    ref_losses, _ = trained_reference("gpt", 1)
    seen.clear()
    with ap.simulate(world_size=2):
        m = build("gpt")
        opt = adamw(m.parameters())
        if form == "ours":
            s = ap.Strategy()
            s.tensor_parallel.degree = 2
            plan = {"blocks.0.mlp.fc1": [ap.ColWiseParallel(), ap.PrepareLayerOutput(_gather_output),
                                         ap.PrepareLayerOutput(_note_output)],
                    "blocks.0.mlp": ap.PrepareLayerInput(_note_input)}
            m, opt = ap.parallelize(m, opt, strategy=s, tp_plan=plan)
        else:
            plan = {"blocks.0.mlp.fc1": [dist.ColWiseParallel(), dist.PrepareLayerOutput(_gather_output),
                                         dist.PrepareLayerOutput(_note_output)],
                    "blocks.0.mlp": dist.PrepareLayerInput(_note_input)}
            m, opt = ap.parallelize(m, opt, dist.ProcessMesh([[0, 1]], ["dp", "mp"]),
                                    {"mp_config": {"parallelize_plan": plan}})
        np.testing.assert_allclose(train_steps(m, opt, 1), ref_losses, rtol=1e-5, atol=1e-6)
    assert ("in", ["data", "model"]) in seen
    outs = [pl for kind, pl in seen if kind == "out"]
    assert outs and all(pl[1] == ap.Shard(2) for pl in outs)        # the column-parallel output: model dim S(2)
    after = [pl for kind, pl in seen if kind == "after"]
    assert after and all(pl == [ap.Replicate(), ap.Replicate()] for pl in after)    # the hook's result is used


def test_prepare_layer_refusals():
    with pytest.raises(TypeError, match="PrepareLayerInput\\(fn\\) expects a callable"):
        ap.PrepareLayerInput()
    with ap.simulate(world_size=2):
        s = ap.Strategy()
        s.tensor_parallel.degree = 2
        m = build("gpt")
        with pytest.raises(ValueError, match="'nothing' matches no layer"):
            ap.parallelize(m, adamw(m.parameters()), strategy=s,
                           tp_plan={"nothing": ap.PrepareLayerInput(_note_input)})


def test_paddles_sequence_parallel_plan_entries_turn_on_sequence_parallelism():
    """paddle's SequenceParallelBegin/Enable/Disable/End in an mp_config plan: sequence parallelism over the
    model dim (norms on sequence shards, row-parallel outputs reduce-scattered); the loss is one process's."""
    ref_losses, ref_params = trained_reference("gpt", 2)
    plan = {"wte": dist.SequenceParallelBegin(), "blocks.*.ln1": dist.SequenceParallelEnable(),
            "blocks.*.ln2": dist.SequenceParallelEnable(), "blocks.*.attn.qkv": dist.ColWiseParallel(),
            "blocks.*.attn.proj": dist.RowWiseParallel(), "blocks.*.attn": dist.SequenceParallelDisable(),
            "blocks.*.mlp.fc1": dist.ColWiseParallel(), "blocks.*.mlp.fc2": dist.RowWiseParallel(),
            "blocks.*.mlp": dist.SequenceParallelDisable(need_transpose=False), "ln_f": dist.SequenceParallelEnd()}
    with ap.simulate(world_size=2):
        m = build("gpt")
        m, opt = ap.parallelize(m, adamw(m.parameters()), dist.ProcessMesh([[0, 1]], ["dp", "mp"]),
                                {"mp_config": {"parallelize_plan": plan}})
        assert layer_state.build_of(m).strategy.sequence_parallel.enable
        outs = []
        dict(m.named_sublayers())["blocks.0.attn.proj"].register_forward_post_hook(
            lambda layer, inputs, out: outs.append(out.placements))
        np.testing.assert_allclose(train_steps(m, opt, 2), ref_losses, rtol=1e-5, atol=1e-6)
        assert outs and all(pl[1] == ap.Shard(1) for pl in outs)        # row-parallel output on sequence shards
        check_every_rank(m, ref_params)
