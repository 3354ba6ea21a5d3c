"""A real rank's gradient bucket is packed into a float32 buffer kept between steps: the reduction writes the
same values back as the functional path, the buffer is reused (not reallocated) while the parameters' local
sizes stay, a parameter without a gradient contributes zeros and keeps no gradient. One process: a one-rank
mesh of the real world (no communication, the same pack / reduce / unpack path as a launched rank)."""
import numpy as np
import paddle

import autoparallel as ap
from autoparallel.local_mode import local_mode
from autoparallel.parallel import grads as G


def _params(shapes, seed=0):
    rng = np.random.default_rng(seed)
    mesh = ap.ProcessMesh([0], ["data"])
    out = []
    for s in shapes:
        p = paddle.create_parameter(list(s), "float32",
                                    default_initializer=paddle.nn.initializer.Assign(rng.standard_normal(s).astype("float32")))
        out.append(ap.shard_tensor(p, mesh, [ap.Replicate()]))
    return mesh, out


def _backward(params, seed):
    """Gradients d/dp sum(p * c) = c for fresh random c: each step's gradients differ."""
    rng = np.random.default_rng(seed)
    want = []
    with local_mode():
        loss = 0.0
        for p in params:
            c = rng.standard_normal(p.locals[0].shape).astype("float32")
            loss = loss + (p.locals[0] * paddle.to_tensor(c)).sum()
            want.append(c)
        loss.backward()
    return want


def test_buffer_is_kept_between_steps_and_values_are_written_back():
    mesh, ps = _params([(4, 3), (5,), (2, 2, 2)])
    bucket = G.Bucket(ps, mesh, (0,))
    for step in range(3):
        for p in ps:
            p.locals[0].clear_gradient(False)
        want = _backward(ps, seed=step)
        G.reduce_bucket(bucket)
        for p, c in zip(ps, want):
            np.testing.assert_array_equal(p.locals[0].grad.numpy(), c)
        flat = bucket.buffers[0]
        if step == 0:
            ptr = flat.buf.data_ptr()
        assert flat.buf.data_ptr() == ptr, "the bucket's buffer must be reused, not reallocated"
        np.testing.assert_array_equal(flat.buf.numpy(), np.concatenate([c.ravel() for c in want]))


def test_missing_gradient_packs_zeros_and_stays_missing():
    mesh, ps = _params([(3,), (4,)])
    bucket = G.Bucket(ps, mesh, (0,))
    with local_mode():
        (ps[1].locals[0] * 2.0).sum().backward()
    bucket.buffers[0] = G._Flat([p.locals[0] for p in ps])
    bucket.buffers[0].buf.set_value(paddle.full([7], 9.0))          # stale values from an earlier step
    G.reduce_bucket(bucket)
    assert ps[0].locals[0].grad is None
    np.testing.assert_array_equal(ps[1].locals[0].grad.numpy(), np.full([4], 2.0, "float32"))
    np.testing.assert_array_equal(bucket.buffers[0].buf.numpy()[:3], np.zeros(3, "float32"))


def test_buffer_is_rebuilt_when_a_local_size_changes():
    mesh, ps = _params([(3,), (4,)])
    bucket = G.Bucket(ps, mesh, (0,))
    old = G._flat(bucket, 0)
    _, (bigger,) = _params([(6,)], seed=1)
    bucket.params[1] = bigger
    new = G._flat(bucket, 0)
    assert new is not old and new.numels == [3, 6]
    assert G._flat(bucket, 0) is new


def test_simulated_world_keeps_the_functional_path():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], ["data"])
        ps = [ap.shard_tensor(paddle.create_parameter([3], "float32"), mesh, [ap.Replicate()]) for _ in range(2)]
        assert not G._keeps_buffer(G.Bucket(ps, mesh, (0,)), [0, 1])
