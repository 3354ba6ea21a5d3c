"""How users start a job and mix paddle's own distributed API with this package (docs/launch_forms.md):
a launched rank before ``init_parallel_env``, the user's own ``paddle.distributed`` collectives on distributed
tensors, ``fleet.distributed_model`` / ``fleet.distributed_optimizer`` over a parallelized model, and the
hybrid degrees of ``fleet.init``. In-process (simulated world, or the launcher's environment faked in one process);
the real-rank outcomes are in the doc's table."""
import numpy as np
import paddle
import paddle.distributed as dist
import pytest

import autoparallel as ap
from autoparallel.comm import world as world_mod


class MLP(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = paddle.nn.Linear(4, 6)
        self.fc2 = paddle.nn.Linear(6, 4)

    def forward(self, x):
        return self.fc2(paddle.nn.functional.relu(self.fc1(x)))


def _tp_model(mesh):
    paddle.seed(0)

    def shard_fn(name, layer, m):
        if name == "fc1":
            layer.weight = ap.shard_tensor(layer.weight, m, [ap.Shard(1)])
    return ap.shard_layer(MLP(), mesh, shard_fn=shard_fn)


# ---- a launched rank before paddle.distributed.init_parallel_env ---------------------------------------------
def test_a_shard_placed_before_init_is_this_ranks_own(monkeypatch):
    """Rank 1 of a launched job that places a tensor before init_parallel_env held rank 0's shard."""
    import paddle.distributed.parallel as pp

    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    monkeypatch.setattr(pp, "_global_parallel_env", None)        # paddle re-reads the launcher's environment
    monkeypatch.setattr(world_mod, "_real", None)
    assert not dist.is_initialized()
    assert (ap.get_rank(), ap.get_world_size()) == (1, 2)
    mesh = ap.ProcessMesh([0, 1], ["x"])
    t = ap.shard_tensor(paddle.arange(4, dtype="float32"), mesh, [ap.Shard(0)])
    np.testing.assert_array_equal(t.local.numpy(), [2.0, 3.0])
    monkeypatch.setattr(pp, "_global_parallel_env", None)
    monkeypatch.setattr(world_mod, "_real", None)


def test_a_mesh_bigger_than_a_world_of_one_is_named_at_its_first_collective():
    """One process (not launched) with a 2-rank mesh: the first collective said 'no communication group ...
    create the mesh on all ranks' (a RuntimeError pointing at the wrong cause)."""
    t = ap.shard_tensor(paddle.arange(4, dtype="float32"), ap.ProcessMesh([0, 1], ["x"]), [ap.Shard(0)])
    with pytest.raises(ValueError, match=r"this job has 1 rank\(s\).*ap.simulate\(world_size=2\)"):
        t.full()


# ---- the user's own collectives on distributed tensors ---------------------------------------------------------
@pytest.mark.parametrize("call", [lambda w: dist.broadcast(w, src=0), lambda w: dist.all_reduce(w),
                                  lambda w: dist.all_gather([], w), lambda w: dist.reduce(w, dst=0)])
def test_collective_on_a_sharded_parameter_is_refused_by_name(call):
    with ap.simulate(world_size=2):
        model = _tp_model(ap.ProcessMesh([0, 1], ["x"]))
        before = {r: t.numpy().copy() for r, t in model.fc1.weight.locals.items()}
        with pytest.raises(TypeError, match=r"paddle\.distributed\.\w+ on a DistParameter .* S\(1\) on mesh dim 'x'"):
            call(model.fc1.weight)
        for r, t in model.fc1.weight.locals.items():           # nothing moved
            np.testing.assert_array_equal(t.numpy(), before[r])


def test_syncing_a_sharded_weights_gradient_by_hand_is_refused():
    """``for p in model.parameters(): dist.all_reduce(p.grad)``: p.grad of a tensor-parallel weight is a plain
    tensor holding this rank's shard of the gradient; summing it over ranks mixes shards."""
    with ap.simulate(world_size=2):
        model = _tp_model(ap.ProcessMesh([0, 1], ["x"]))
        opt = ap.shard_optimizer(paddle.optimizer.SGD(0.1, parameters=model.parameters()))   # kept, as a loop does
        model(paddle.ones([2, 4])).sum().backward()
        with pytest.raises(TypeError, match=r"gradient of .* placed S\(1\) on mesh dim 'x'"):
            dist.all_reduce(model.fc1.weight.grad)
        with pytest.raises(RuntimeError, match="global group is not initialized"):   # replicated: paddle's call
            dist.all_reduce(model.fc2.weight.grad)
        opt.clear_grad()


def test_reducing_a_value_computed_on_distributed_tensors_is_refused_and_broadcast_keeps_it():
    """A replicated loss already holds the whole global batch's value on every rank: a sum over ranks would count
    each sample once per rank (a count metric silently x world), so all_reduce / reduce / all_gather refuse it;
    broadcast of the same value on every rank leaves it as it is."""
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], ["x"])
        x = ap.shard_tensor(paddle.to_tensor([1.5, -2.0]), mesh, [ap.Replicate()])
        for call in (lambda: dist.all_reduce(x), lambda: dist.all_reduce(x, op=dist.ReduceOp.MAX),
                     lambda: dist.reduce(x, dst=0), lambda: dist.all_gather([], x)):
            with pytest.raises(TypeError, match="already the whole global batch's on every rank"):
                call()
        np.testing.assert_allclose(x.full().numpy(), [1.5, -2.0])
        dist.broadcast(x, src=0)
        np.testing.assert_allclose(x.full().numpy(), [1.5, -2.0])
        sharded = ap.shard_tensor(paddle.arange(4, dtype="float32"), mesh, [ap.Shard(0)])
        with pytest.raises(TypeError, match=r"layout \['S\(0\)'\], global shape \[4\]"):
            dist.all_reduce(sharded)
        with pytest.raises(TypeError, match="DistTensor of global shape \\[4\\] placed S\\(0\\)"):
            dist.broadcast(sharded, src=0)                      # a shard is refused by the layout guard
    with ap.simulate(world_size=4):
        half = ap.shard_tensor(paddle.ones([2]), ap.ProcessMesh([0, 1], ["x"]), [ap.Replicate()])
        with pytest.raises(ValueError, match=r"ranks \[2, 3\] hold no part of it"):
            dist.broadcast(half, src=0)                         # the whole world of 4 over a 2-rank mesh


def test_plain_tensors_reach_paddle_unchanged():
    t = paddle.ones([2])
    with pytest.raises(RuntimeError, match="global group is not initialized"):   # paddle's own, one process
        dist.all_reduce(t)


# ---- fleet over a model this package parallelized --------------------------------------------------------------
def test_fleet_wrappers_over_distributed_parameters_are_refused():
    from paddle.distributed import fleet

    with ap.simulate(world_size=2):
        model = _tp_model(ap.ProcessMesh([0, 1], ["x"]))
        opt = ap.shard_optimizer(paddle.optimizer.SGD(0.1, parameters=model.parameters()))
        with pytest.raises(NotImplementedError, match="fleet.distributed_model over MLP"):
            fleet.distributed_model(model)
        with pytest.raises(NotImplementedError, match="fleet.distributed_optimizer over"):
            fleet.distributed_optimizer(opt)
        inner = paddle.optimizer.SGD(0.1, parameters=model.parameters())
        with pytest.raises(NotImplementedError, match="fleet.distributed_optimizer over SGD"):
            fleet.distributed_optimizer(inner)


class _FakeFleet:
    """What fleet.init(is_collective=True, strategy=s) leaves on paddle.distributed.fleet.fleet."""

    def __init__(self, **hybrid):
        self._hcg = object()
        self._user_defined_strategy = type("S", (), {"hybrid_configs": dict(
            {"dp_degree": -1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1, "sep_degree": 1}, **hybrid)})()


@pytest.mark.parametrize("hybrid, ok", [({}, True), ({"dp_degree": 2, "mp_degree": 2}, True),
                                        ({"mp_degree": 4}, False), ({"dp_degree": 4}, False),
                                        ({"pp_degree": 2}, False), ({"sep_degree": 2}, None)])
def test_fleet_hybrid_degrees_must_be_the_strategys(monkeypatch, hybrid, ok):
    import paddle.distributed.fleet as fleet

    monkeypatch.setattr(fleet, "fleet", _FakeFleet(**hybrid))
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = 2, 2
    with ap.simulate(world_size=4):
        model = MLP()
        opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
        plan = {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()}
        if ok:
            ap.parallelize(model, opt, strategy=s, tp_plan=plan)
        elif ok is None:
            with pytest.raises(NotImplementedError, match="sep_degree=2"):
                ap.parallelize(model, opt, strategy=s, tp_plan=plan)
        else:
            name = next(iter(hybrid))
            with pytest.raises(ValueError, match=f"fleet.init's hybrid_configs {name}={hybrid[name]} but"):
                ap.parallelize(model, opt, strategy=s, tp_plan=plan)


# ---- the user's collectives in the collective log ---------------------------------------------------------------
def test_user_collectives_are_noted_in_the_collective_log(monkeypatch):
    """A launched job's user collective is noted (kind, group, size; not the line: ranks may make one collective
    from different lines), so one made on some ranks only is named by the watchdog; point-to-point calls and the
    library's own calls are not noted."""
    from autoparallel.comm import collective_log

    with ap.simulate(world_size=2):                           # a script places a tensor first (installs the guards)
        ap.shard_tensor(paddle.ones([2]), ap.ProcessMesh([0, 1], ["x"]), [ap.Replicate()])
    log = collective_log.Log()
    monkeypatch.setattr(collective_log, "LOG", log)
    monkeypatch.setattr(collective_log, "enabled", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)     # a launched world of 2, as far as the note goes
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    t = paddle.ones([2, 3])
    for call in (lambda: dist.all_reduce(t), lambda: dist.send(t, dst=1)):
        with pytest.raises(Exception):                        # paddle itself: no process group in this process
            call()
    lib = {"__name__": "autoparallel.comm.fake", "dist": dist, "t": t}
    with pytest.raises(Exception):
        exec("dist.all_reduce(t)", lib)
    try:
        dist.barrier()
    except Exception:                                         # noqa: BLE001  (paddle's, one process)
        pass
    log.drain()
    records = [r[:2] + r[3:] for g in log._groups.values() for r in g.recent]
    assert list(log._groups) == [(0, 1)], records
    assert records == [[1, "all_reduce", "all_reduce@the user's paddle.distributed call"],
                       [2, "barrier", "barrier@the user's paddle.distributed call"]]
    assert log._groups[(0, 1)].recent[0][2] == 24             # the payload's bytes


# ---- a PaddleFormers config's own parallel flags through ap.to_static (ap.parallelize: test_probe_pf_config_flags)
@pytest.mark.parametrize("flags, error, match", [
    ({"tensor_parallel_degree": 2}, None, None),
    ({"tensor_parallel_degree": 4}, ValueError, "ap.to_static: model.config.tensor_parallel_degree=4 but"),
    ({"sep_parallel_degree": 2}, NotImplementedError, "ap.to_static: model.config.sep_parallel_degree=2"),
    ({"context_parallel_size": 2}, NotImplementedError, "ap.to_static: model.config.context_parallel_size=2"),
    ({"sequence_parallel": True}, ValueError, "ap.to_static: model.config.sequence_parallel=True makes the model")])
def test_to_static_honours_or_refuses_a_models_own_parallel_flags(flags, error, match):
    """ap.to_static captured such a model and ran another layout than its config declares, silently."""
    from autoparallel.testing import paddleformers_models as pf

    if not pf.available():
        pytest.skip("paddleformers not installed (pip install -e .[models])")
    with ap.simulate(world_size=2):
        model = pf.build("llama", **{k: v for k, v in flags.items() if k != "sequence_parallel"})
        for k, v in flags.items():
            setattr(model.config, k, v)                      # recorded after the build (the check reads the config)
        s = ap.Strategy()
        s.tensor_parallel.degree = 2
        if error is None:
            assert type(ap.to_static(model, None, None, None, strategy=s, input_spec=[([4, 8], "int64")])).__name__ \
                == "DistModel"
            return
        with pytest.raises(error, match=match):
            ap.to_static(model, None, None, None, strategy=s, input_spec=[([4, 8], "int64")])


def test_the_stream_variants_are_guarded_too():
    with ap.simulate(world_size=2):
        model = _tp_model(ap.ProcessMesh([0, 1], ["x"]))
        with pytest.raises(TypeError, match=r"paddle\.distributed\.broadcast on a DistParameter"):
            dist.stream.broadcast(model.fc1.weight, src=0)


def test_the_guard_looks_past_wrappers_that_only_hand_the_users_call_on():
    """PerformanceMonitor times paddle.distributed's collectives by wrapping them (autoparallel.monitor), and
    collective_forms checks their arguments: a user's call through either is still the user's. Before, the guard
    took it for the library's own and handed a DistTensor to paddle ('argument (position 1) must be Tensor, but
    got DistTensor' on real ranks)."""
    import sys

    from autoparallel import collective_forms, collective_guard
    from autoparallel.monitor import _comm_timer

    seen = []

    def guard(*args, **kwargs):              # stands where collective_guard's wrapper runs
        seen.append(collective_guard._from_library(sys._getframe(1)))

    _comm_timer._wrap(guard)()
    collective_forms._guarded("all_reduce", 0, guard)(paddle.ones([1]))
    _comm_timer._wrap(collective_forms._guarded("all_reduce", 0, guard))(paddle.ones([1]))
    assert seen == [False, False, False]
