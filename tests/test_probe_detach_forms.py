"""``detach()`` as paddle gives it: the detach of a distributed parameter (its local shard, DESIGN "Shapes") read by
a routed op next to distributed tensors stands for the parameter's global value, not for a replicated tensor of
the shard's shape; a DistTensor's detach shares its storage, so an in-place op on either is seen by the other.
Every value against the same code in one process."""
import numpy as np
import paddle
import pytest

import autoparallel as ap

A = np.arange(8, dtype="float32").reshape(4, 2) - 3.0
LAYOUTS = [[ap.Shard(0)], [ap.Shard(1)], [ap.Replicate()]]


def _weight_use(dist, placements=None):
    paddle.seed(0)
    lin = paddle.nn.Linear(2, 4)
    x = paddle.to_tensor(A)
    x.stop_gradient = False
    if dist:
        mesh = ap.ProcessMesh([0, 1, 2, 3])
        lin.weight = ap.shard_tensor(lin.weight, mesh, placements)
        x = ap.shard_tensor(x, mesh, [ap.Replicate()], stop_gradient=False)
    y = paddle.matmul(x, lin.weight.detach()) + lin.weight.detach().sum() * 0 + lin(x)
    y.sum().backward()
    return y.numpy(), x.grad.numpy()


@pytest.mark.parametrize("placements", [[ap.Shard(1)], [ap.Shard(0)]], ids=str)
def test_detach_of_a_sharded_parameter_is_its_global_value_in_routed_ops(placements):
    ref = _weight_use(False)
    with ap.simulate(world_size=4):
        got = _weight_use(True, placements)
    assert got[0].shape == ref[0].shape == (4, 4)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-6)


def test_detach_of_a_parameter_on_another_mesh_is_refused():
    with ap.simulate(world_size=4):
        lin = paddle.nn.Linear(2, 4)
        lin.weight = ap.shard_tensor(lin.weight, ap.ProcessMesh([0, 1]), [ap.Shard(1)])
        x = ap.shard_tensor(paddle.to_tensor(A), ap.ProcessMesh([0, 1, 2, 3]), [ap.Replicate()])
        with pytest.raises(ValueError, match="detach\\(\\) of distributed parameter .* lives on mesh"):
            paddle.matmul(x, lin.weight.detach())


def _write_through_detach(h):
    e = h.detach()
    e.scale_(2.0)
    return e


def _write_the_base(h):
    e = h.detach()
    h.scale_(3.0)
    return e


def _both(h):
    e = h.detach()
    e.add_(e)
    h.scale_(0.5)
    f = h.detach()
    f.subtract_(paddle.ones([2]))
    return e + f


@pytest.mark.parametrize("form", [_write_through_detach, _write_the_base, _both], ids=lambda f: f.__name__)
@pytest.mark.parametrize("placements", LAYOUTS, ids=str)
def test_detach_shares_storage_with_its_source(form, placements):
    h = paddle.to_tensor(A)
    ref = form(h).numpy(), h.numpy()
    with ap.simulate(world_size=4):
        d = ap.shard_tensor(paddle.to_tensor(A), ap.ProcessMesh([0, 1, 2, 3]), placements)
        got = form(d).numpy(), d.numpy()
    assert not np.array_equal(ref[1], A)                     # the form changes the source in one process
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-6)
