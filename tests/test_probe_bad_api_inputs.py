"""Bad inputs to the public API found by a sweep of every public name (beyond tests/test_bad_inputs.py): each is
refused at the boundary with a typed error naming what was expected and what was given, and the forms paddle (or
Python) accepts -- numpy ints for ints, numpy bools for flags, paddle's ``None`` out placement of ``local_map``, an
integer tensor over ``Partial("avg")`` -- are accepted with the values they mean. Every case runs under a deadline."""
import json
import re

import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.checkpoint import CheckpointOwnershipError, CheckpointRootError
from autoparallel.planner.model_spec import ModelSpec
from bad_inputs_helpers import deadline
from spmd_rules import register_spmd_rule

CLUSTER = "1x8:A100-80GB"


def mesh():
    return ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])


def in_world(fn):
    def run(tmp_path=None):
        with ap.simulate(world_size=4):
            return fn()
    return run


def dist_tensor():
    return ap.shard_tensor(paddle.ones([4, 4]), mesh(), [ap.Shard(0), ap.Replicate()])


def mlp():
    return paddle.nn.Sequential(paddle.nn.Linear(8, 8), paddle.nn.ReLU(), paddle.nn.Linear(8, 8))


def sgd(layer):
    return paddle.optimizer.SGD(parameters=layer.parameters())


def set_field(path, value):
    s = ap.Strategy()
    *head, last = path.split(".")
    obj = s
    for name in head:
        obj = getattr(obj, name)
    setattr(obj, last, value)
    return s


def to_static_with_foreign_optimizer():
    from paddle.io import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset([paddle.randn([8, 8]), paddle.randn([8, 8])]), batch_size=4)
    return ap.to_static(mlp(), loader, paddle.nn.MSELoss(), sgd(mlp()))


def a_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    return str(path)


def a_busy_dir(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    return str(tmp_path / "busy")


def bad_json(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text("[1")
    return str(path)


# (id, fn(tmp_path), exception type, message pattern)
CASES = [
    # strategy fields
    ("seed-beyond-numpy", lambda t: set_field("seed", 2 ** 32), ValueError,
     r"seed must be an integer in \[0, 2\*\*32 - 1\], got 4294967296"),
    ("loss-scaling-nan", lambda t: set_field("amp.init_loss_scaling", float("nan")), ValueError,
     r"amp.init_loss_scaling must be a finite number, got nan"),
    ("loss-scaling-inf", lambda t: set_field("amp.incr_ratio", float("inf")), ValueError,
     r"amp.incr_ratio must be a finite number, got inf"),
    ("sharding-stage-float", lambda t: set_field("sharding.stage", 2.0), TypeError,
     r"sharding.stage must be 1, 2 or 3 \(an int\), got float 2.0"),
    ("Strategy.from_json-int", lambda t: ap.Strategy.from_json(3), TypeError,
     r"Strategy.from_json expects JSON text \(a str starting with '\{'\) or a file path, got int 3"),
    # worlds, meshes, layouts
    ("simulate-bool", lambda t: ap.simulate(world_size=True).__enter__(), ValueError,
     r"simulate\(world_size\) expects a positive int, got True"),
    ("mesh-shape-str", lambda t: ap.ProcessMesh(shape="22", process_ids=[0, 1, 2, 3]), TypeError,
     r"shape must be a non-empty list of ints, got str '22'"),
    ("mesh-shape-negative", lambda t: ap.ProcessMesh(shape=[-2, -2], process_ids=[0, 1, 2, 3]), ValueError,
     r"shape must hold positive sizes, got \[-2, -2\]"),
    ("mesh-process_ids-int", lambda t: ap.ProcessMesh(shape=[1], process_ids=3), TypeError,
     r"process_ids must be a list of ranks, got int 3"),
    ("shard_tensor-placements-set", in_world(lambda: ap.shard_tensor(paddle.ones([4, 4]), mesh(), {ap.Replicate()})),
     TypeError, r"list/tuple in mesh-dim order .* got the unordered set \{R\}"),
    ("reshard-outside-world", in_world(lambda: ap.reshard(dist_tensor(), ap.ProcessMesh([4, 5]), [ap.Replicate()])),
     ValueError, r"ranks \[4, 5\] are outside the simulated world of 4 ranks"),
    ("dtensor_to_local-mesh-str", in_world(lambda: ap.dtensor_to_local(dist_tensor(), "m")), TypeError,
     r"dtensor_to_local: mesh must be a ProcessMesh .* got str 'm'"),
    ("local_map-in_placements", lambda t: ap.local_map(lambda x: x, [[ap.Replicate()]], in_placements=3), TypeError,
     r"in_placements is one placement list \(or None\) per input, got int 3"),
    ("local_map-out_placements", lambda t: ap.local_map(lambda x: x, [["Q"]]), ValueError,
     r"malformed placement 'Q'"),
    ("local_map-reshard_inputs", lambda t: ap.local_map(lambda x: x, [[ap.Replicate()]], reshard_inputs="yes"),
     TypeError, r"reshard_inputs must be True or False, got str 'yes'"),
    ("mesh-get_group-dim", in_world(lambda: mesh().get_group("zz")), ValueError,
     r"mesh has dims \['dp', 'tp'\], got dim name 'zz'"),
    ("register_spmd_rule-int", lambda t: register_spmd_rule(3), TypeError,
     r"op name or a list of op names, got int 3"),
    ("dispatch_mode-force", lambda t: ap.dispatch_mode(force="x").__enter__(), TypeError,
     r"dispatch_mode\(force=...\) expects a bool, got str 'x'"),
    ("profile-cluster", lambda t: ap.profile(cluster=3), TypeError,
     r"cluster spec string like '128x8:A100-80GB' or a ClusterSpec, got int"),
    # optimizers, static graphs
    ("shard_optimizer-accumulation-bool", in_world(lambda: ap.shard_optimizer(sgd(mlp()),
                                                                              gradient_accumulation_steps=True)),
     ValueError, r"gradient_accumulation_steps must be an int >= 1, got True"),
    ("ShardingStage-dim-index", lambda t: ap.ShardingStage1(9, mesh=mesh()), ValueError,
     r"ShardingStage1: sharding_mesh_dim=9 is outside the mesh's 2 dims \['dp', 'tp'\]"),
    ("ShardingStage-dim-name", lambda t: ap.ShardingStage3("zz", mesh=mesh()), ValueError,
     r"ShardingStage3: sharding_mesh_dim='zz' is not a dim of the mesh \['dp', 'tp'\]"),
    ("to_static-foreign-optimizer", in_world(to_static_with_foreign_optimizer), ValueError,
     r"ap.to_static: 4 of the optimizer's 4 parameters are not parameters of the Sequential"),
    # checkpoints
    ("save-onto-a-file", lambda t: ap.save_state_dict({"w": paddle.ones([2])}, a_file(t)), CheckpointOwnershipError,
     r"the path already exists and is a file; save to a new or empty directory"),
    ("save-into-a-foreign-dir", lambda t: ap.save_state_dict({"w": paddle.ones([2])}, a_busy_dir(t)),
     CheckpointOwnershipError, r"already exists and is not a checkpoint written by autoparallel .* \['notes.txt'\]"),
    ("CheckpointManager-file", lambda t: ap.CheckpointManager(a_file(t)), CheckpointRootError,
     r"checkpoint root '.*notes.txt' is a file, expected a directory"),
    ("resume-from-a-file", lambda t: ap.resume_from_last_checkpoint(mlp(), sgd(mlp()), dir=a_file(t)),
     CheckpointRootError, r"is a file, expected a directory"),
    ("resume-strict", lambda t: ap.resume_from_last_checkpoint(mlp(), dir=str(t), strict="yes"), TypeError,
     r"strict must be a bool, got str 'yes'"),
    # monitoring
    ("monitor-num_stages", lambda t: ap.PerformanceMonitor(num_stages=0), ValueError,
     r"num_stages must be an int >= 1 or None, got 0"),
    ("monitor-split", lambda t: ap.PerformanceMonitor(split=3), TypeError,
     r"split must be a list of \(first layer, end layer\) pairs, one per stage .* got 3"),
    ("monitor-layer_names", lambda t: ap.PerformanceMonitor(layer_names="blocks"), TypeError,
     r"layer_names must be a list of layer names \(str\), got 'blocks'"),
    ("monitor-clock", lambda t: ap.PerformanceMonitor(clock=3), TypeError, r"clock must be a callable .* got int 3"),
    ("monitor-pipeline", lambda t: ap.PerformanceMonitor(pipeline="pp"), TypeError,
     r"pipeline must be a PipelineModule .* or None, got str"),
    # planning
    ("plan-constraint-str", lambda t: ap.plan("llama2-7b", CLUSTER, global_batch_size=8, tp="x"), ValueError,
     r"constraint 'tp' takes positive integers \(degrees, sizes\), got \['x'\]"),
    ("plan-constraint-float", lambda t: ap.plan("llama2-7b", CLUSTER, global_batch_size=8, tp=[2.0]), ValueError,
     r"constraint 'tp' takes positive integers .* got \[2.0\]"),
    ("plan-constraint-negative", lambda t: ap.plan("llama2-7b", CLUSTER, global_batch_size=8, pp=[-2]), ValueError,
     r"constraint 'pp' takes positive integers .* got \[-2\]"),
    ("plan-constraint-stage", lambda t: ap.plan("llama2-7b", CLUSTER, global_batch_size=8, sharding=[4]), ValueError,
     r"sharding must be among \(0, 1, 2, 3\), got \[4\]"),
    ("plan-fixed-float", lambda t: ap.plan("llama2-7b", CLUSTER, global_batch_size=8, fixed={"dp": 2.5, "tp": 4}),
     ValueError, r"dp must be an integer, got float 2.5"),
    ("plan-cluster-missing", lambda t: ap.plan("llama2-7b", str(t / "nope.json"), global_batch_size=8),
     FileNotFoundError, r"cluster profile '.*nope.json' is not a file: expected a profile .json"),
    ("plan-cluster-bad-json", lambda t: ap.plan("llama2-7b", bad_json(t), global_batch_size=8), ValueError,
     r"cluster profile '.*profile.json' is not valid JSON"),
    ("ModelSpec-bool", lambda t: ModelSpec(name="x", hidden=True, layers=2, heads=1, vocab=8), ValueError,
     r"model 'x': hidden must be a positive integer, got True"),
]


@pytest.mark.parametrize("fn,exc,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_naming_it(fn, exc, match, tmp_path):
    with deadline():
        with pytest.raises(exc) as info:
            fn(tmp_path)
    assert re.search(match, str(info.value)), f"{type(info.value).__name__}: {info.value}"


def test_a_refused_checkpoint_target_is_left_alone(tmp_path):
    """Neither a file nor a directory of something else is touched by the refused save."""
    path, busy = a_file(tmp_path), a_busy_dir(tmp_path)
    for target in (path, busy):
        with deadline(), pytest.raises(FileExistsError):          # CheckpointOwnershipError is a FileExistsError
            ap.save_state_dict({"w": paddle.ones([2])}, target, overwrite=True)
    assert open(path).read() == "mine" and open(busy + "/notes.txt").read() == "mine"


# ---- accepted forms ----------------------------------------------------------------------------------------
def test_numpy_scalars_are_accepted_as_the_ints_and_bools_they_are():
    with deadline():
        s = ap.Strategy()
        s.sharding.stage = np.int64(2)
        s.amp.enable = np.bool_(True)
        s.seed = np.int64(7)
        assert (s.sharding.stage, s.amp.enable, s.seed) == (2, True, 7)
        assert type(s.sharding.stage) is int and type(s.amp.enable) is bool
        assert json.loads(s.to_json())["sharding"]["stage"] == 2           # numpy's int64 is not JSON
        assert ap.Strategy.from_json(s.to_json()) == s
        s.gradient_merge.k_steps = np.int64(4)                   # paddle's section names, numpy values
        s.gradient_merge.enable = np.bool_(True)
        s.pipeline.enable = np.bool_(False)
        s.sharding.comm_buffer_size_MB = np.int64(256)          # paddle's default: accepted, nothing to do
        assert s.gradient_accumulation_steps == 4 and s.gradient_merge.enable is True
        with pytest.raises(NotImplementedError, match=r"comm_buffer_size_MB=512 is not supported"):
            s.sharding.comm_buffer_size_MB = np.int64(512)

        mon = ap.PerformanceMonitor(np.int64(1), np.int64(3), num_stages=np.int64(2), split=[(0, 1), (1, 2)])
        assert (mon.warmup_steps, mon.measure_steps, mon.num_stages) == (1, 3, 2)
        assert type(mon.measure_steps) is int

        assert ap.SequenceParallel(seq_dim=np.int64(1)) == ap.SequenceParallel(seq_dim=1)
        assert type(ap.RowWiseParallel(seq_dim=np.int64(0)).seq_dim) is int
        assert ap.BlockShard(np.int64(0), blocks=(2, 2)) == ap.BlockShard(0, blocks=(2, 2))
        assert len(ap.ByteTextDataset(np.int64(8), files=[__file__])[0][0]) == 8
        loader = ap.DistributedDataLoader(list(range(8)), np.int64(4))
        assert loader.global_batch_size == 4 and type(loader.global_batch_size) is int
        from autoparallel.watchdog import MemoryStore

        wd = ap.Watchdog(timeout=1.0, rank=np.int64(0), world_size=np.int64(1), store=MemoryStore(),
                         install_handlers=False)
        assert (wd.rank, wd.world_size) == (0, 1) and type(wd.rank) is int

        m = ap.ProcessMesh([[0, 1, 2], [3, 4, 5]], dim_names=["a", "b"])
        assert m.get_dim_size(np.int64(1)) == m.get_dim_size(1) == 3
        assert m.get_dim_size(np.int64(-1)) == 3
        with pytest.raises(ValueError, match="got True"):
            m.get_dim_size(True)


def test_numpy_ints_reach_the_runtime_as_ints(tmp_path):
    with deadline():
        with ap.simulate(world_size=np.int64(4)):
            assert ap.get_world_size() == 4
            layer = ap.shard_layer(mlp(), mesh())
            opt = ap.shard_optimizer(sgd(layer), gradient_accumulation_steps=np.int64(2))
            assert opt.gradient_accumulation_steps == 2 and type(opt.gradient_accumulation_steps) is int
            stage = ap.ShardingStage3(np.int64(0), mesh=mesh())
            assert stage.sharding_mesh_dim == 0 and stage.dim_name(mesh()) == "dp"
            from paddle.io import DataLoader, TensorDataset

            loader = DataLoader(TensorDataset([paddle.arange(16, dtype="float32").reshape([8, 2])]), batch_size=4)
            one_d = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
            by_np = [b[0].placements for b in ap.shard_dataloader(loader, one_d, shard_dims=np.int64(0))]
            by_int = [b[0].placements for b in ap.shard_dataloader(loader, one_d, shard_dims=0)]
            assert by_np == by_int and by_int[0] == [ap.Shard(0)]
        path = ap.save_state_dict({"w": paddle.ones([2])}, str(tmp_path / "ck"), block_bytes=np.int64(1024))
        assert ap.load_merged_state_dict(path)["w"].tolist() == [1.0, 1.0]
        cm = ap.CheckpointManager(str(tmp_path / "run"), save_interval_steps=np.int64(3), keep_last=np.int64(2))
        assert (cm.save_interval_steps, cm.keep_last) == (3, 2)


def test_numpy_ints_in_recompute_layers():
    class Stack(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.blocks = paddle.nn.LayerList([paddle.nn.Linear(4, 4) for _ in range(4)])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    with deadline():
        model = Stack()
        x = paddle.randn([2, 4])
        want = model(x).numpy()
        out = ap.recompute_layers(model, checkpoint_every_n_layers=np.int64(2))
        assert out is model
        np.testing.assert_allclose(model(x).numpy(), want, rtol=1e-6)


def test_numpy_ints_in_the_planner_equal_python_ints():
    with deadline():
        base = ap.plan("llama2-7b", CLUSTER, global_batch_size=8, seq_len=1024, top=2, tp=2)
        numpy = ap.plan("llama2-7b", CLUSTER, global_batch_size=np.int64(8), seq_len=np.int64(1024), top=np.int64(2),
                        tp=np.int64(2))
        assert [c.config for c in numpy.candidates] == [c.config for c in base.candidates]
        assert numpy.candidates[0].config.tp == 2
        fixed_np = ap.plan("llama2-7b", CLUSTER, global_batch_size=8, fixed={"dp": np.int64(8)})
        fixed_text = ap.plan("llama2-7b", CLUSTER, global_batch_size=8, fixed="dp=8")
        assert fixed_np.explanation == fixed_text.explanation
        spec = ModelSpec(name="x", hidden=np.int64(32), layers=np.int64(2), heads=4, vocab=256, seq_len=16)
        assert type(spec.hidden) is int and spec.hidden == 32
        assert ap.plan(spec, CLUSTER, global_batch_size=8).feasible
        flags = ap.plan("llama2-7b", CLUSTER, global_batch_size=8, tp=2, sp=[True], offload=False)
        assert all(c.config.sp == 1 and c.config.offload == 0 for c in flags.candidates)


def test_an_int_tensor_over_partial_avg_keeps_its_dtype_as_paddle_does():
    """paddle's ``shard_tensor`` of an int64 tensor over ``Partial(avg)`` is an int64 tensor; reducing it keeps the
    dtype (the average truncated, as the gloo transport's cast back does), on the way to Replicate and to Shard."""
    import paddle.distributed as dist

    pm = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    want_dtype = dist.shard_tensor(paddle.ones([4], "int64"), pm, [dist.Partial(dist.ReduceType.kRedAvg)]).dtype
    with deadline(), ap.simulate(world_size=4):
        m = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
        same = ap.shard_tensor(paddle.to_tensor([7, 8, 9, 10], "int64"), m, [ap.Partial("avg")])
        rep = ap.reshard(same, m, [ap.Replicate()])
        assert same.dtype == rep.dtype == rep.local.dtype == want_dtype == paddle.int64
        assert rep.full().numpy().tolist() == [7, 8, 9, 10]
        parts = ap.dtensor_from_local({r: paddle.to_tensor([r, 1, 2, 3 * r], "int64") for r in range(4)}, m,
                                      [ap.Partial("avg")])
        for target in ([ap.Replicate()], [ap.Shard(0)]):
            out = ap.reshard(parts, m, target)
            assert all(out.local_of(r).dtype == paddle.int64 for r in range(4))
            assert out.full().numpy().tolist() == [1, 1, 2, 4]      # (0+1+2+3)/4, 4/4, 8/4, 18/4 truncated


def test_local_map_non_tensor_outputs_take_none_as_in_paddle():
    """paddle's ``local_map``: 'For non-tensor outputs, the corresponding placement must be None'."""
    with deadline(), ap.simulate(world_size=4):
        x = ap.shard_tensor(paddle.arange(8, dtype="float32").reshape([4, 2]), mesh(), [ap.Shard(0), ap.Replicate()])
        double, rows = ap.local_map(lambda t: (t * 2, int(t.shape[0])), [[ap.Shard(0), ap.Replicate()], None])(x)
        assert double.full().numpy().tolist() == [[0, 2], [4, 6], [8, 10], [12, 14]] and rows == 2
        assert ap.local_map(lambda: "done", [None])() == "done"           # no distributed input, no mesh needed
        with pytest.raises(ValueError, match="pass process_mesh"):
            ap.local_map(lambda: paddle.ones([2]), [[ap.Replicate()]])()


def test_a_bool_tensor_over_partial_max_and_min_reduces_as_any_and_all():
    """paddle has no CPU maximum kernel for bool: the simulated reduction carries bools in int32 instead of leaking
    paddle's 'kernel maximum is not registered' error."""
    with deadline(), ap.simulate(world_size=4):
        m = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
        rows = {0: [True, False, False], 1: [False, False, False], 2: [False, True, False], 3: [False, False, False]}
        want = {"max": [True, True, False], "min": [False, False, False], "sum": [True, True, False]}
        for op, expected in want.items():
            x = ap.dtensor_from_local({r: paddle.to_tensor(v) for r, v in rows.items()}, m, [ap.Partial(op)])
            out = ap.reshard(x, m, [ap.Replicate()])
            assert out.local.dtype == paddle.bool and out.full().numpy().tolist() == expected, op


def test_dtensor_from_local_with_more_placements_than_mesh_dims_names_the_count():
    """Two Shards on a 1-D mesh, no global_shape: the count is refused by name (the global shape's inference read
    a mesh dim past the mesh's and raised a raw IndexError)."""
    with ap.simulate(world_size=2):
        m = ap.ProcessMesh([0, 1], dim_names=["x"])
        with pytest.raises(ValueError, match="expected 1 placements"):
            ap.dtensor_from_local({r: paddle.ones([2, 2]) for r in range(2)}, m, [ap.Shard(0), ap.Shard(1)])
