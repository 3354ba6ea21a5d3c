"""Bad inputs to the public ``ap.*`` entry points: each is refused at the boundary with a typed error that states
what was expected and what was given, and none hangs (every case runs under a deadline)."""
import re

import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.planner.search import divisors
from autoparallel.watchdog import MemoryStore
from reshard import plan_reshard
from bad_inputs_helpers import deadline


def mesh():
    return ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])


def in_world(fn):
    def run():
        with ap.simulate(world_size=4):
            return fn()
    return run


def dist_tensor():
    return ap.shard_tensor(paddle.ones([4, 4]), mesh(), [ap.Shard(0), ap.Replicate()])


def watchdog(**kw):
    kw = {"timeout": 1.0, "rank": 0, "world_size": 1, "store": MemoryStore(), "install_handlers": False, **kw}
    return ap.Watchdog(**kw)


def long_wait_negative():
    wd = watchdog().start()
    try:
        with wd.long_wait("checkpoint write", seconds=-3):
            pass
    finally:
        wd.stop()


def sgd(layer):
    return paddle.optimizer.SGD(parameters=layer.parameters())


CASES = [
    # layouts
    ("mesh-str", lambda: ap.ProcessMesh("abc"), TypeError, r"integer ranks, got dtype <U3 from 'abc'"),
    ("mesh-duplicates", lambda: ap.ProcessMesh([0, 0, 1]), ValueError, r"unique, got duplicates \[0\]"),
    ("mesh-ragged", lambda: ap.ProcessMesh([[0, 1], [2]]), ValueError, r"rectangular .* got \[\[0, 1\], \[2\]\]"),
    ("mesh-names", lambda: ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["x"]), ValueError,
     r"needs 2 dim_names, got \['x'\]"),
    ("shard-str", lambda: ap.Shard("a"), TypeError, r"expects an int tensor dim, got str 'a'"),
    ("partial-prod", lambda: ap.Partial("prod"), ValueError, r"one of \('sum', 'avg', 'max', 'min'\), got 'prod'"),
    ("parse-placements", lambda: ap.parse_placements("S(x),R"), ValueError, r"malformed placement 'S\(x\)'"),
    # distributed tensors
    ("shard_tensor-count", in_world(lambda: ap.shard_tensor(paddle.ones([4, 4]), mesh(), [ap.Shard(0), ap.Replicate(),
                                                                               ap.Replicate()])),
     ValueError, r"expected 2 placements .* got 3"),
    ("shard_tensor-dim", in_world(lambda: ap.shard_tensor(paddle.ones([4, 4]), mesh(), [ap.Shard(5), ap.Replicate()])),
     ValueError, r"S\(5\) is out of range for a tensor of rank 2"),
    ("shard_tensor-data", in_world(lambda: ap.shard_tensor("abc", mesh(), [ap.Shard(0), ap.Replicate()])),
     TypeError, r"expects a paddle.Tensor .* got str 'abc'"),
    ("complete-model", lambda: ap.complete(3), TypeError, r"complete expects the model as a paddle.nn.Layer .* got int 3"),
    ("shard_tensor-mesh", in_world(lambda: ap.shard_tensor(paddle.ones([4]), [0, 1], [ap.Shard(0)])),
     TypeError, r"expected a ProcessMesh, got list"),
    ("shard_tensor-placement-type", in_world(lambda: ap.shard_tensor(paddle.ones([4, 4]), mesh(), [1, 2])),
     TypeError, r"Shard/Replicate/Partial, got int 1"),
    ("shard_tensor-outside-world", lambda: _in_small_world(), ValueError,
     r"ranks \[2, 3\] are outside the simulated world of 2 ranks"),
    ("reshard-plain", in_world(lambda: ap.reshard(paddle.ones([4]), mesh(), [ap.Replicate()] * 2)), TypeError,
     r"expects a DistTensor or DistParameter, got Tensor"),
    ("reshard-count", in_world(lambda: ap.reshard(dist_tensor(), mesh(), [ap.Replicate()] * 3)), ValueError,
     r"expected 2 placements .* got 3"),
    ("reshard-dim", in_world(lambda: ap.reshard(dist_tensor(), mesh(), [ap.Shard(3), ap.Replicate()])), ValueError,
     r"S\(3\) is out of range"),
    ("dtensor_from_local-ndarray", in_world(lambda: ap.dtensor_from_local(np.ones(4), mesh(), [ap.Replicate()] * 2)),
     TypeError, r"expected a paddle.Tensor .* got ndarray"),
    ("dtensor_from_local-missing-ranks", in_world(lambda: ap.dtensor_from_local(
        {0: paddle.ones([2, 4])}, mesh(), [ap.Shard(0), ap.Replicate()])), ValueError, r"missing \[1, 2, 3\]"),
    ("dtensor_from_local-global-shape-str", in_world(lambda: ap.dtensor_from_local(
        {r: paddle.ones([2, 4]) for r in range(4)}, mesh(), [ap.Shard(0), ap.Replicate()], global_shape="x")),
     TypeError, r"global shape must be a sequence of ints, got 'x'"),
    ("dtensor_from_local-global-shape-negative", in_world(lambda: ap.dtensor_from_local(
        {r: paddle.ones([2, 4]) for r in range(4)}, mesh(), [ap.Shard(0), ap.Replicate()], global_shape=[-4, 4])),
     ValueError, r"sizes >= 0, got \[-4, 4\]"),
    ("dtensor_from_local-global-shape-wrong", in_world(lambda: ap.dtensor_from_local(
        {r: paddle.ones([2, 4]) for r in range(4)}, mesh(), [ap.Shard(0), ap.Replicate()], global_shape=[3, 4])),
     ValueError, r"local shape \[2, 4\] disagrees with the spec: expected \[1, 4\]"),
    # worlds, strategy, planning
    ("simulate-zero", lambda: ap.simulate(world_size=0).__enter__(), ValueError, r"positive int, got 0"),
    ("simulate-str", lambda: ap.simulate(world_size="4").__enter__(), ValueError, r"positive int, got '4'"),
    ("simulate-huge", lambda: ap.simulate(world_size=10 ** 12).__enter__(), ValueError,
     r"at most 2\*\*20 ranks .* got 1000000000000"),
    ("strategy-field", lambda: setattr(ap.Strategy(), "foo", 1), AttributeError, r"no field 'foo'; valid fields"),
    ("strategy-degree-str", lambda: setattr(ap.Strategy().tensor_parallel, "degree", "2"), TypeError,
     r"integer >= 1, got '2'"),
    ("strategy-schedule", lambda: setattr(ap.Strategy().pipeline_parallel, "schedule", "zz"), ValueError,
     r"'FThenB', '1F1B', 'VPP' or 'ZB-H1', got 'zz'"),
    ("strategy-from_dict", lambda: ap.Strategy.from_dict([1]), TypeError, r"as a dict, got list"),
    ("strategy-json", lambda: ap.Strategy.from_json("{not json"), ValueError, r"invalid strategy JSON"),
    ("plan-model", lambda: ap.plan("nope", "1x8:A100-80GB", global_batch_size=8), ValueError,
     r"unknown model 'nope': expected a preset"),
    ("plan-cluster-type", lambda: ap.plan("llama2-7b", 8, global_batch_size=8), TypeError,
     r"cluster spec string .* got int"),
    ("plan-batch-float", lambda: ap.plan("llama2-7b", "1x8:A100-80GB", global_batch_size=8.0), ValueError,
     r"positive integer, got 8.0"),
    ("plan-batch-missing", lambda: ap.plan("llama2-7b", "1x8:A100-80GB"), ValueError, r"positive integer, got None"),
    ("plan-batch-huge", lambda: ap.plan("llama2-7b", "1x8:A100-80GB", global_batch_size=10 ** 18), ValueError,
     r"expected an integer in \[1, 2\*\*40\] .* got 125000000000000000"),
    ("plan-cluster-huge", lambda: ap.plan("llama2-7b", "1x99999999999999:A100-80GB", global_batch_size=8), ValueError,
     r"expected an integer in \[1, 2\*\*40\] .* got 99999999999999"),
    ("plan-fixed", lambda: ap.plan("llama2-7b", "1x8:A100-80GB", global_batch_size=8, fixed="dp=banana"), ValueError,
     r"dp must be an integer, got 'banana'"),
    ("plan-options", lambda: ap.plan("llama2-7b", "1x8:A100-80GB", global_batch_size=8, options=3), TypeError,
     r"PlannerOptions, got int"),
    ("set_cluster", lambda: ap.set_cluster("x"), ValueError, r"malformed cluster spec 'x': expected 'NODESxGPUS:TYPE'"),
    ("divisors-bound", lambda: divisors(2 ** 41), ValueError, r"\[1, 2\*\*40\] .* got 2199023255552"),
    ("plan_reshard-huge", lambda: plan_reshard([99999999999, 99999999999, 999999999], "float32",
                                               ap.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]]), "S(0),R", "R,S(1)"),
     ValueError, r"global_shape \[99999999999, 99999999999, 999999999\] holds 1e\+31 elements, beyond 2\*\*53"),
    # layers and optimizers
    ("shard_layer-not-layer", in_world(lambda: ap.shard_layer(3, mesh())), TypeError,
     r"expects a paddle.nn.Layer, got int"),
    ("shard_layer-mesh", in_world(lambda: ap.shard_layer(paddle.nn.Linear(4, 4), "mesh")), TypeError,
     r"expects a ProcessMesh, got str"),
    ("shard_layer-shard_fn", in_world(lambda: ap.shard_layer(paddle.nn.Linear(4, 4), mesh(), shard_fn=3)), TypeError,
     r"shard_fn must be a callable \(name, sublayer, mesh\) or None, got int"),
    ("shard_layer-output_fn", in_world(lambda: ap.shard_layer(paddle.nn.Linear(4, 4), mesh(), output_fn="x")),
     TypeError, r"output_fn must be a callable .* got str"),
    ("shard_optimizer-type", in_world(lambda: ap.shard_optimizer(3)), TypeError, r"paddle optimizer, got int"),
    ("shard_optimizer-accumulation", in_world(lambda: ap.shard_optimizer(sgd(paddle.nn.Linear(4, 4)),
                                                                         gradient_accumulation_steps=0)),
     ValueError, r"int >= 1, got 0"),
    ("parallelize-strategy", in_world(lambda: ap.parallelize(paddle.nn.Linear(4, 4), None, strategy={"tp": 2})),
     TypeError, r"ap.Strategy, got dict"),
    ("parallelize-mesh", in_world(lambda: ap.parallelize(paddle.nn.Linear(4, 4), None, mesh="m")), TypeError,
     r"ap.ProcessMesh, got str"),
    ("parallelize-optimizer", in_world(lambda: ap.parallelize(paddle.nn.Linear(4, 4), "adam")), TypeError,
     r"paddle optimizer, got str"),
    ("Optimizer", in_world(lambda: ap.Optimizer(3)), TypeError, r"expects a paddle optimizer, got int"),
    ("parallelize-model", in_world(lambda: ap.parallelize(3)), TypeError,
     r"ap.parallelize expects the model as a paddle.nn.Layer, got int 3"),
    ("parallelize-tp_plan-list", in_world(lambda: ap.parallelize(paddle.nn.Linear(4, 4), tp_plan=[ap.ColWiseParallel()])),
     TypeError, r"tp_plan must be a dict from layer-name patterns to styles .* got list"),
    ("parallelize-tp_plan-style", in_world(lambda: ap.parallelize(paddle.nn.Linear(4, 4), tp_plan={"fc": "colwise"})),
     TypeError, r"tp_plan\['fc'\] must be one of \['ColWiseParallel', .* got str 'colwise'"),
    ("parallelize-tp_plan-key", in_world(lambda: ap.parallelize(paddle.nn.Linear(4, 4), tp_plan={0: ap.ColWiseParallel()})),
     TypeError, r"tp_plan keys are layer-name patterns \(str\), got int 0"),
    ("DataParallel-model", in_world(lambda: ap.DataParallel(3)), TypeError,
     r"ap.DataParallel expects the model as a paddle.nn.Layer, got int 3"),
    ("DataParallel-tp_plan", in_world(lambda: ap.DataParallel(paddle.nn.Linear(4, 4), tp_plan="fc")), TypeError,
     r"ap.DataParallel: tp_plan must be a dict .* got str 'fc'"),
    ("Optimizer-strategy", in_world(lambda: ap.Optimizer(sgd(paddle.nn.Linear(4, 4)), strategy="dp")), TypeError,
     r"ap.Optimizer: strategy must be an ap.Strategy, got str"),
    ("parallel_guard-int", lambda: ap.parallel_guard(3), TypeError,
     r"parallel_guard expects a list of mesh dim names \(of \['data', 'model'\]\), got int 3"),
    ("parallel_guard-str", lambda: ap.parallel_guard("data"), TypeError, r"list of mesh dim names .* got str 'data'"),
    ("parallel_guard-unknown", lambda: ap.parallel_guard(["dp"]), ValueError,
     r"unknown mesh dim names \['dp'\]; ap.parallelize's mesh has dims \['data', 'model'\], got dims=\['dp'\]"),
    ("parallel_guard-twice", lambda: ap.parallel_guard(["data", "data"]), ValueError,
     r"named once, got dims=\['data', 'data'\]"),
    ("shard_optimizer-shard_fn", in_world(lambda: ap.shard_optimizer(sgd(paddle.nn.Linear(4, 4)), shard_fn=3)),
     TypeError, r"shard_fn must be None, ap.ShardingStage1/2/3, a ProcessMesh or a callable .*; got int"),
    ("apply_tp-plan-list", in_world(lambda: ap.apply_tp(paddle.nn.Linear(4, 4), mesh(), [ap.ColWiseParallel()], "tp")),
     TypeError, r"tensor-parallel plan is a dict from layer-name patterns to styles, got list"),
    ("apply_tp-model", in_world(lambda: ap.apply_tp(3, mesh(), {}, "tp")), TypeError,
     r"apply_tp expects the model as a paddle.nn.Layer, got int"),
    ("apply_tp-mesh", in_world(lambda: ap.apply_tp(paddle.nn.Linear(4, 4), [0, 1], {}, "tp")), TypeError,
     r"apply_tp expects a ProcessMesh, got list"),
    ("ColWiseParallel-flag", lambda: ap.ColWiseParallel(gather_output="yes"), TypeError,
     r"ColWiseParallel\(gather_output=...\) expects True or False, got str 'yes'"),
    ("RowWiseParallel-seq_dim", lambda: ap.RowWiseParallel(seq_dim=-1), ValueError,
     r"RowWiseParallel\(seq_dim=...\) expects a tensor dim \(an int >= 0\), got -1"),
    ("SequenceParallel-seq_dim", lambda: ap.SequenceParallel(seq_dim="1"), TypeError, r"an int >= 0\), got str '1'"),
    ("reduce_gradients-layer", in_world(lambda: ap.reduce_gradients(paddle.nn.Linear(2, 2))), TypeError,
     r"iterable of parameters \(e.g. model.parameters\(\)\), got Linear"),
    ("reduce_gradients-int", in_world(lambda: ap.reduce_gradients(3)), TypeError, r"iterable of parameters .* got int"),
    ("materialize", lambda: ap.materialize(3), TypeError, r"materialize expects a paddle.nn.Layer, got int"),
    ("profile-gather", lambda: ap.profile(gather="x"), TypeError, r"profile\(gather=...\) expects a bool, got 'x'"),
    ("strategy-from_dict-section", lambda: ap.Strategy.from_dict({"tensor_parallel": 3}), TypeError,
     r"tensor_parallel must be a TensorParallelConfig \(or a dict of its fields\), got int"),
    ("strategy-from_dict-flag", lambda: ap.Strategy.from_dict({"recompute": {"enable": "yes"}}), TypeError,
     r"recompute.enable must be True or False, got 'yes'"),
    ("strategy-from_dict-float", lambda: ap.Strategy.from_dict({"gradient_accumulation_steps": 2.5}), TypeError,
     r"gradient_accumulation_steps must be an integer >= 1, got 2.5"),
    ("strategy-from_dict-stage", lambda: ap.Strategy.from_dict({"sharding": {"stage": 4}}), ValueError,
     r"sharding.stage must be 1, 2 or 3, got 4"),
    ("strategy-from_dict-dtype", lambda: ap.Strategy.from_dict({"amp": {"dtype": "float99"}}), ValueError,
     r"amp.dtype must be 'bfloat16' or 'float16', got 'float99'"),
    ("strategy-from_dict-key", lambda: ap.Strategy.from_dict({"bogus": 3}), ValueError,
     r"Strategy has no field 'bogus'; valid fields"),
    ("DistributedDataLoader-mesh", in_world(lambda: ap.DistributedDataLoader([1, 2, 3, 4], 2, mesh="m")), TypeError,
     r"mesh must be an ap.ProcessMesh or None, got str 'm'"),
    ("DistributedDataLoader-data_dims", in_world(lambda: ap.DistributedDataLoader([1, 2, 3, 4], 2, mesh=mesh(),
                                                                                  data_dims="dp")),
     TypeError, r"data_dims must be a list of mesh dim names, got 'dp'"),
    ("recompute_layers-n-str", lambda: ap.recompute_layers(paddle.nn.Linear(2, 2), checkpoint_every_n_layers="2"),
     ValueError, r"checkpoint_every_n_layers must be an int >= 1, got '2'"),
    ("load_state_dict-state", lambda: ap.load_state_dict(3, "/tmp/ap-never-created"), TypeError,
     r"a state must be a dict \(nested dicts allowed\), got int"),
    ("recompute_layers-not-layer", lambda: ap.recompute_layers(3), TypeError, r"paddle.nn.Layer, got int"),
    ("recompute_layers-segment_func", lambda: ap.recompute_layers(paddle.nn.Linear(2, 2), segment_func=3), TypeError,
     r"segment_func must be a predicate layer -> bool or a function model -> list of layers, got int"),
    ("recompute_layers-n", lambda: ap.recompute_layers(paddle.nn.Linear(2, 2), checkpoint_every_n_layers=0),
     ValueError, r"got 0"),
    ("to_static-model", lambda: ap.to_static(3, None, None, None, input_spec=[([2, 4], "float32")]), TypeError,
     r"to_static expects a paddle.nn.Layer, got int"),
    ("to_static-loss", lambda: ap.to_static(paddle.nn.Linear(4, 4), None, "mse", None), TypeError,
     r"loss_fn must be a callable .* got str"),
    ("to_static-input_spec", lambda: ap.to_static(paddle.nn.Linear(4, 4), None, None, None, input_spec=3), TypeError,
     r"input_spec must be a list of \(shape, dtype\) pairs or InputSpecs, one per batch field, got int 3"),
    ("apply_pp-model", lambda: ap.apply_pp(3), TypeError, r"apply_pp expects the model as a paddle.nn.Layer, got int"),
    ("trace", lambda: ap.trace(lambda x: x, 3), TypeError, r"DistSpec inputs, got \['int'\]"),
    ("apply_pp", lambda: ap.apply_pp(paddle.nn.Linear(2, 2)), ValueError, r"degree >= 2, got 1"),
    # data, monitoring, checkpoints, reliability
    ("ByteTextDataset", lambda: ap.ByteTextDataset(0), ValueError, r"seq_len must be a positive integer, got 0"),
    ("DistributedDataLoader", lambda: ap.DistributedDataLoader([1, 2, 3], "8"), ValueError,
     r"global_batch_size must be a positive integer, got '8'"),
    ("PerformanceMonitor", lambda: ap.PerformanceMonitor("2"), ValueError, r"warmup_steps must be an int >= 0, got '2'"),
    ("CheckpointManager", lambda: ap.CheckpointManager("/tmp/ap-never-created", save_interval_steps=0), ValueError,
     r"save_interval_steps must be a positive int, got 0"),
    ("reconfigure", lambda: ap.reconfigure(3, 4, 5), TypeError, r"new_strategy must be an ap.Strategy .* got int 5"),
    ("Watchdog-timeout-str", lambda: watchdog(timeout="soon"), TypeError,
     r"timeout must be a number of seconds, got str 'soon'"),
    ("Watchdog-timeout-nan", lambda: watchdog(timeout=float("nan")), ValueError, r"positive finite .* got nan"),
    ("Watchdog-timeout-inf", lambda: watchdog(timeout=float("inf")), ValueError, r"positive finite .* got inf"),
    ("Watchdog-interval", lambda: watchdog(interval=5), ValueError, r"interval must be below timeout=1 s, got 5"),
    ("Watchdog-long-wait", lambda: watchdog(long_wait_timeout=600), ValueError,
     r"long_wait_timeout must be in \(0, 2\] s .* got 600"),
    ("Watchdog-rank", lambda: watchdog(rank=3, world_size=2), ValueError, r"rank must be in \[0, 2\), got 3"),
    ("Watchdog-world", lambda: watchdog(world_size=0), ValueError, r"world_size must be >= 1, got 0"),
    ("Watchdog-rank-alone", lambda: watchdog(world_size=None), ValueError,
     r"pass rank and world_size together .* got rank=0, world_size=None"),
    ("Watchdog-exit-code", lambda: watchdog(exit_code=0), ValueError, r"\[1, 255\] .* got 0"),
    ("Watchdog-exit-code-str", lambda: watchdog(exit_code="x"), TypeError, r"int in \[1, 255\], got 'x'"),
    ("Watchdog-on_failure", lambda: watchdog(on_failure=3), TypeError, r"on_failure must be a callable or None, got int"),
    ("Watchdog-store", lambda: watchdog(store=3), TypeError, r"store must have set.* got int"),
    ("Watchdog-peers", lambda: watchdog(rank=0, world_size=2, peers=[5]), ValueError,
     r"peers must be other ranks in \[0, 2\) \(this rank is 0\), got \[5\]"),
    ("Watchdog-peers-type", lambda: watchdog(rank=0, world_size=2, peers="1"), TypeError,
     r"list of int ranks, got '1'"),
    ("Watchdog-long_wait-seconds", long_wait_negative, ValueError,
     r"long_wait seconds must be a positive finite number of seconds, got -3"),
]


def _in_small_world():
    with ap.simulate(world_size=2):
        ap.shard_tensor(paddle.ones([4, 4]), mesh(), [ap.Shard(0), ap.Replicate()])


@pytest.mark.parametrize("fn,exc,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_named(fn, exc, match):
    with deadline():
        with pytest.raises(exc) as info:
            fn()
    assert re.search(match, str(info.value)), f"{type(info.value).__name__}: {info.value}"


def test_the_deadline_catches_a_hang():
    """Negative control: a case that never ends fails within its deadline instead of stalling the suite."""
    import time

    from bad_inputs_helpers import CaseHang

    start = time.monotonic()
    with pytest.raises(CaseHang, match="ran beyond 0.3 s"):
        with deadline(0.3):
            while True:
                time.sleep(0.01)
    assert time.monotonic() - start < 2.0


def test_good_inputs_pass_the_same_checks():
    """The checks refuse only what is wrong: the well-formed neighbours of the cases above are accepted."""
    with deadline():
        with ap.simulate(world_size=4):
            layer = ap.shard_layer(paddle.nn.Linear(4, 4), mesh(), shard_fn=lambda n, s, m: None)
            assert all(ap.is_dist(p) for p in layer.parameters())
            d = ap.dtensor_from_local({r: paddle.ones([2, 4]) for r in range(4)}, mesh(),
                                      [ap.Shard(0), ap.Replicate()], global_shape=[4, 4])
            assert d.global_shape == [4, 4] or tuple(d.global_shape) == (4, 4)
            with ap.parallel_guard(("data", "model")), ap.parallel_guard([]):
                pass
            plan = {"fc": ap.ColWiseParallel(gather_output=True), "out": ap.RowWiseParallel(seq_dim=0)}
            from autoparallel.parallelize import check_tp_plan

            check_tp_plan(plan, "ap.parallelize")
            assert ap.reduce_gradients(layer.parameters()) == 0 and ap.reduce_gradients(iter([])) == 0
        wd = watchdog(exit_code=3, on_failure=print, peers=None)
        assert (wd.exit_code, wd.timeout, wd.long_wait_timeout) == (3, 1.0, 2.0)
        assert divisors(2 ** 40)[-3:] == [2 ** 38, 2 ** 39, 2 ** 40] and divisors(12) == [1, 2, 3, 4, 6, 12]


def test_public_functions_stay_functions_after_their_modules_are_imported():
    """``from autoparallel.parallelize import ...`` sets the package attribute ``parallelize`` to the module;
    ``ap.parallelize`` and ``ap.local_mode`` must still be the functions users call."""
    import importlib
    import sys

    for name in ("parallelize", "local_mode"):
        module = importlib.import_module(f"autoparallel.{name}")
        assert sys.modules[f"autoparallel.{name}"] is module
        assert getattr(ap, name) is getattr(module, name) and callable(getattr(ap, name))
        assert vars(ap)[name] is module or vars(ap)[name] is getattr(module, name)    # what the import set


def test_a_checkpoint_load_names_itself_to_the_watchdog(tmp_path, monkeypatch):
    """Peers of a rank lost during a load read 'checkpoint load' as its operation in flight (as a save's
    'checkpoint write'), and the operation before the load is back afterwards."""
    import json

    import autoparallel.checkpoint.load as load

    path = ap.save_state_dict({"w": paddle.ones([2, 3])}, str(tmp_path / "ckpt"))
    store = MemoryStore()
    wd = watchdog(store=store, interval=0.1).start()
    seen = []
    real = load._assign

    def published():                       # what peers read: the record the I/O thread publishes
        import time

        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            op = json.loads(store.get(wd._key("rec", 0)))["op"]
            if op == "checkpoint load":
                return op
            time.sleep(0.02)
        return op

    def spy(*args):
        seen.append((wd._op[0] if wd._op else None, published()))
        return real(*args)

    monkeypatch.setattr(load, "_assign", spy)
    target = {"w": paddle.zeros([2, 3])}
    try:
        with deadline(), wd.op("training step"):
            ap.load_state_dict(target, path)
            after = wd._op[0]
    finally:
        wd.stop()
    assert seen == [("checkpoint load", "checkpoint load")], seen
    assert after == "training step"
    assert np.array_equal(target["w"].numpy(), np.ones([2, 3], "float32"))
