"""DistTensor basics and bad input, in the simulated world."""
import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.mesh import mesh_from_shape
from autoparallel.testing.check import assemble
from rule_removal import rule_removed


def test_shapes_are_global_and_locals_follow_ceil_division():
    with ap.simulate(4):
        mesh = mesh_from_shape([4])
        dt = ap.shard_tensor(paddle.arange(35, dtype="float32").reshape([7, 5]), mesh, [ap.Shard(0)])
        assert dt.shape == [7, 5] and dt.global_shape == [7, 5]
        assert [dt.local_of(r).shape[0] for r in range(4)] == [2, 2, 2, 1]
        five = ap.shard_tensor(paddle.ones([5, 2]), mesh, [ap.Shard(0)])
        assert [five.local_of(r).shape[0] for r in range(4)] == [2, 2, 1, 0]
        assert np.allclose(dt.full().numpy(), np.arange(35).reshape(7, 5))


def test_parameter_becomes_dist_parameter_with_local_shape():
    with ap.simulate(2):
        mesh = mesh_from_shape([2])
        lin = paddle.nn.Linear(4, 6)
        w = ap.shard_tensor(lin.weight, mesh, [ap.Shard(1)])
        assert isinstance(w, ap.DistParameter) and isinstance(w, paddle.base.framework.EagerParamBase)
        assert list(w.shape) == [4, 3] and w.global_shape == [4, 6]
        lin.weight = w                     # paddle accepts it in a parameter slot
        assert np.allclose(assemble(w.locals, w.spec), lin.weight.full().numpy())


def test_dtensor_from_local_roundtrip_and_inference():
    with ap.simulate(2):
        mesh = mesh_from_shape([2])
        parts = [paddle.ones([3, 4]), paddle.zeros([3, 4])]
        dt = ap.dtensor_from_local(parts, mesh, [ap.Shard(0)])
        assert dt.shape == [6, 4] and float(dt.full().sum()) == 12.0


@pytest.mark.parametrize("local,kw,err", [
    ([paddle.ones([3, 4]), paddle.ones([2, 4])], {}, r"rank 1: local shape \[2, 4\] disagrees.*expected \[3, 4\]"),
    ([paddle.ones([3, 4]), paddle.ones([3, 4])], {"global_shape": [5, 4]}, r"rank 1: local shape \[3, 4\] disagrees.*expected \[2, 4\]"),
    ([paddle.ones([3, 4]), paddle.ones([3, 4])], {"dtype": "float64"}, r"dtype mismatch.*float64.*float32"),
    ([paddle.ones([3, 4])], {}, r"expected 2 local tensors"),
    ([paddle.ones([3, 4]), paddle.ones([3, 4], dtype="float64")], {}, r"rank 1: local dtype float64"),
])
def test_dtensor_from_local_rejects_disagreeing_shards(local, kw, err):
    with ap.simulate(2):
        with pytest.raises(ValueError, match=err):
            ap.dtensor_from_local(local, mesh_from_shape([2]), [ap.Shard(0)], **kw)


def test_bad_placements_are_rejected_before_any_work():
    with ap.simulate(4):
        mesh = mesh_from_shape([2, 2])
        x = paddle.ones([4, 4])
        with pytest.raises(ValueError, match="expected 2 placements"):     # a shorter list is padded (paddle)
            ap.shard_tensor(x, mesh, [ap.Shard(0), ap.Replicate(), ap.Replicate()])
        with pytest.raises(ValueError, match=r"S\(2\) is out of range for a tensor of rank 2"):
            ap.shard_tensor(x, mesh, [ap.Shard(2), ap.Replicate()])
        with pytest.raises(TypeError, match="ProcessMesh"):
            ap.shard_tensor(x, [[0, 1], [2, 3]], [ap.Shard(0), ap.Replicate()])


def test_rank_outside_the_mesh_has_no_shard():
    with ap.simulate(4):
        dt = ap.shard_tensor(paddle.ones([4]), ap.ProcessMesh([0, 1]), [ap.Shard(0)])
        with pytest.raises(ValueError, match=r"rank 3 is not in the mesh \[0, 1\]"):
            dt.local_of(3)


def test_simulate_rejects_bad_world_and_ranks_beyond_it():
    with pytest.raises(ValueError, match="positive int"):
        with ap.simulate(0):
            pass
    with ap.simulate(2):
        with pytest.raises(ValueError, match="outside the simulated world"):
            ap.shard_tensor(paddle.ones([4]), ap.ProcessMesh([0, 1, 2]), [ap.Shard(0)])


def test_backward_grad_validation():
    with ap.simulate(2):
        dt = ap.shard_tensor(paddle.ones([4]), mesh_from_shape([2]), [ap.Shard(0)], stop_gradient=False)
        with pytest.raises(TypeError, match="expects None, a tensor or a DistTensor"):
            dt.backward(grad=np.ones(4))


# ---- metadata paddle code reads: answered without communication ------------------------------------------------
import contextlib  # noqa: E402

from autoparallel.comm import collectives as _C  # noqa: E402


@contextlib.contextmanager
def _count_collectives():
    """Counts every simulated collective (gather, reduce, all_to_all...) run inside the block."""
    calls = []
    names = [n for n in vars(_C) if n.endswith("_raw") and n != "_slice_raw"]
    saved = {n: getattr(_C, n) for n in names}
    for n in names:
        setattr(_C, n, (lambda f, n: lambda *a, **k: (calls.append(n), f(*a, **k))[1])(saved[n], n))
    try:
        yield calls
    finally:
        for n, f in saved.items():
            setattr(_C, n, f)


def _batch_sharded():
    mesh = mesh_from_shape([2, 2], ["data", "model"])
    full = np.arange(5 * 3 * 4, dtype="float32").reshape(5, 3, 4)
    return full, ap.shard_tensor(paddle.to_tensor(full), mesh, [ap.Shard(0), ap.Shard(2)])


def test_metadata_without_communication():
    with ap.simulate(4):
        full, x = _batch_sharded()
        with _count_collectives() as calls:
            assert x.dim() == x.ndim == x.ndimension() == 3
            assert int(x.numel()) == x.size == full.size
            assert x.contiguous() is x and x.is_contiguous()
            assert x.place.is_cpu_place()
            assert x.dtype == paddle.float32 and x.element_size() == 4
            assert len(x) == 5 and x.stop_gradient
            assert paddle.is_tensor(x)
            rows = list(x)
            assert calls == []
        assert len(rows) == 5 and all(isinstance(r, ap.DistTensor) and r.shape == [3, 4] for r in rows)
        for i, r in enumerate(rows):
            np.testing.assert_array_equal(r.numpy(), full[i])


def test_is_tensor_is_true_but_isinstance_is_false():
    """A DistTensor is a wrapper over per-rank shards, not a C++ tensor: paddle's kernels would read its
    (absent) storage, so ``isinstance(x, paddle.Tensor)`` stays false; ``paddle.is_tensor`` says True."""
    with ap.simulate(2):
        x = ap.shard_tensor(paddle.ones([4]), mesh_from_shape([2]), [ap.Shard(0)])
        assert paddle.is_tensor(x) and not isinstance(x, paddle.Tensor)
        assert paddle.is_tensor(paddle.ones([1])) and not paddle.is_tensor([1.0])


def test_model_output_of_a_distributed_loss_does_not_gather():
    """Library code that iterates a tensor it does not recognise (PaddleFormers' ModelOutput) reads one
    row: with the batch sharded that is a local Partial row, no collective."""
    mo = pytest.importorskip("paddleformers.transformers.model_outputs", reason="PaddleFormers (models extra)")
    with ap.simulate(4):
        _, x = _batch_sharded()
        with _count_collectives() as calls:
            out = mo.CausalLMOutputWithPast(x)           # only the first field: ModelOutput iterates it
            assert out.loss is x
        assert calls == []
        with _count_collectives() as calls:              # the counter sees a gather (control)
            x.full()
        assert calls


def test_a_non_op_says_it_has_no_meaning_for_a_distributed_tensor():
    with ap.simulate(2):
        x = ap.shard_tensor(paddle.ones([4]), mesh_from_shape([2]), [ap.Shard(0)])
        with pytest.raises(TypeError, match="not an op and has no meaning for a distributed tensor"):
            x.data_ptr()
        with rule_removed("atan2"), pytest.raises(NotImplementedError, match="register_spmd_rule"):
            x.atan2(x)                           # an op without a rule (the test removes atan2's)
        with pytest.raises(ValueError, match="ambiguous"):
            bool(x)
        assert bool(x[1]) and int(x.sum()) == 4
        assert x.cpu() is x and x.tolist() == [1.0] * 4
        with pytest.raises(TypeError, match="integer tensors"):
            range(x[0])
        i = ap.shard_tensor(paddle.arange(4), mesh_from_shape([2]), [ap.Shard(0)])
        assert list(range(i[3])) == [0, 1, 2] and [9, 8, 7, 6][i[2]] == 7


def test_place_of_a_tensor_this_process_holds_no_shard_of_is_its_own_device(monkeypatch):
    """A rank outside the mesh holds no shard: ``place`` is where this process puts new tensors (its own GPU
    under launch, not GPU 0 whenever paddle has CUDA)."""
    with ap.simulate(4):
        _, x = _batch_sharded()
        monkeypatch.setattr(x, "_locals", {})
        monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
        assert x.place.is_cpu_place() and str(x.place) == str(paddle.framework._current_expected_place())
