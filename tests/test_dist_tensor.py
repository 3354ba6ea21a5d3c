"""DistTensor basics and bad input, in the simulated world."""
import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.mesh import mesh_from_shape
from autoparallel.testing.check import assemble


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
        with pytest.raises(TypeError, match="expects None or a DistTensor"):
            dt.backward(grad=np.ones(4))
