"""Chains of ops on DistTensors (views, slicing, broadcasting, reductions, joins, in-place, where, matmul,
expand, gather, reshard, diagonals and windows, scatters into a slice; uneven shards; 1-d and 2x2 meshes) equal the same chain on full tensors, values and
input gradients. A lean fixed set runs here; AP_FUZZ_CHAINS=N runs N chains."""
import collections
import os

import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.mesh import mesh_from_shape
from spmd_rules.validation import chains as C
from spmd_rules.validation.chain_ops import OPS

N = int(os.environ.get("AP_FUZZ_CHAINS", "60"))
BAD = ("wrong value", "wrong grad", "crash")


def test_fixed_chains_match_full_tensors():
    bad = []
    for seed in range(N):
        chain = C.build_chain(seed)
        outcome, detail = C.run_chain(chain)
        if outcome in BAD or outcome == "refused" and "shares storage" not in detail:
            bad.append(f"{outcome}: {detail} | {chain.describe()}")
    assert not bad, "\n".join(bad)


def test_generator_is_seeded_and_covers_every_op_family_and_both_meshes():
    assert C.build_chain(3).describe() == C.build_chain(3).describe()
    chains = [C.build_chain(s) for s in range(150)]
    ops = collections.Counter(st.op for c in chains for st in c.steps)
    assert set(ops) == set(OPS)
    assert {tuple(c.mesh_shape) for c in chains} == {(4,), (2, 2)}
    assert all(2 <= len(c.steps) <= 6 for c in chains if len(c.steps) >= 2)
    assert any(c.x.shape and c.x.shape[0] % 4 for c in chains)       # uneven sizes occur


def test_negative_control_a_wrong_assembly_is_caught(monkeypatch):
    from autoparallel.testing import check
    orig = check.assemble
    monkeypatch.setattr(check, "assemble", lambda loc, spec: orig(loc, spec) + 1.0)
    outcomes = {C.run_chain(C.build_chain(s))[0] for s in range(3)}
    assert outcomes <= {"wrong value", "refused", "artefact"} and "wrong value" in outcomes


def test_max_over_an_axis_sharded_on_two_mesh_dims_with_an_empty_shard():
    full = np.random.default_rng(0).standard_normal([2, 6]).astype("float32")
    with ap.simulate(world_size=4):
        mesh = mesh_from_shape([2, 2], ["a", "b"])
        x = ap.shard_tensor(paddle.to_tensor(full), mesh, [ap.Shard(0), ap.Shard(0)])   # rows 1, 0, 1, 0
        x.stop_gradient = False
        m = x.max(axis=0)
        np.testing.assert_allclose(m.numpy(), full.max(0))
        m.sum().backward()
        np.testing.assert_allclose(x.grad.numpy(), (full == full.max(0)).astype("float32"))


def test_gradient_of_a_setitem_value_with_empty_shards():
    v_full = np.arange(2, dtype="float32")
    with ap.simulate(world_size=4):
        mesh = mesh_from_shape([2, 2], ["a", "b"])
        v = ap.shard_tensor(paddle.to_tensor(v_full), mesh, [ap.Shard(0), ap.Shard(0)])   # two ranks hold none
        v.stop_gradient = False
        t = ap.shard_tensor(paddle.zeros([2]), mesh, [ap.Shard(0), ap.Shard(0)]) * 1.0
        t[0:2] = v
        (t * paddle.to_tensor([2.0, 3.0])).sum().backward()
        assert v.grad is not None
        np.testing.assert_allclose(v.grad.numpy(), [2.0, 3.0])


def test_flatten_over_a_sharded_size_one_dim():
    full = np.random.default_rng(1).standard_normal([2, 1, 1]).astype("float32")
    with ap.simulate(world_size=4):
        mesh = mesh_from_shape([2, 2], ["a", "b"])
        x = ap.shard_tensor(paddle.to_tensor(full), mesh, [ap.Shard(1), ap.Shard(0)])
        x.stop_gradient = False
        y = paddle.flatten(x, 0, 1)
        np.testing.assert_allclose(y.numpy(), full.reshape(2, 1))
        (y * 3.0).sum().backward()
        np.testing.assert_allclose(x.grad.numpy(), np.full([2, 1, 1], 3.0))


VIEWS = {"slice": lambda t: t[0:1], "reshape": lambda t: t.reshape([4, 2]), "T": lambda t: t.T,
         "column": lambda t: t[:, 1], "unsqueeze of T": lambda t: t.T.unsqueeze(0),
         "reshape of a slice": lambda t: t[0:1].reshape([4]), "slice of a slice": lambda t: t[:, 1:3][0:1]}
COPIES = {"split": lambda t: paddle.split(t, 2, axis=1)[0], "index tensor": lambda t: t[paddle.to_tensor([0])],
          "reshape of T": lambda t: t.T.reshape([8])}


@pytest.mark.parametrize("name", sorted(VIEWS) + sorted(COPIES))
def test_in_place_write_through_a_view_reaches_the_base_as_in_paddle(name):
    """paddle's views share storage: a write through one changes the base (and a copy does not). A DistTensor's
    shards never alias: the write is carried back into the base (setitem / reshape / inverse transpose)."""
    x0 = paddle.arange(8, dtype="float32").reshape([2, 4])
    t_ref = x0 * 1
    f = VIEWS.get(name) or COPIES[name]
    f(t_ref).scale_(10.0)
    assert np.array_equal(t_ref.numpy(), x0.numpy()) == (name in COPIES)
    for pl in ([ap.Shard(1)], [ap.Shard(0)], [ap.Replicate()]):
        with ap.simulate(world_size=2):
            x = ap.shard_tensor(x0, mesh_from_shape([2], ["a"]), pl)
            x.stop_gradient = False
            t = x * 1
            f(t).scale_(10.0)
            np.testing.assert_array_equal((t + 0).numpy(), t_ref.numpy())
            w = paddle.arange(8, dtype="float32").reshape([2, 4])
            (t * w).sum().backward()
            m = paddle.ones([2, 4])
            f(m).scale_(10.0)            # the true gradient: w times the scale each element got
            np.testing.assert_allclose(x.grad.numpy(), (w * m).numpy())    # (paddle 3.3's own misses the 10)


def test_a_view_read_after_its_base_was_written_in_place_is_refused():
    x0 = paddle.arange(8, dtype="float32").reshape([2, 4])
    with ap.simulate(world_size=2):
        t = ap.shard_tensor(x0, mesh_from_shape([2], ["a"]), [ap.Shard(0)]) * 1
        s, other = t[0:1], t[1]
        s.scale_(2.0)                   # carried into t; the sibling view `other` is now stale
        np.testing.assert_array_equal(t.numpy()[0], x0.numpy()[0] * 2)
        with pytest.raises(NotImplementedError, match="shares storage"):
            other + 1
        v = t.T
        t.scale_(3.0)                   # paddle: v changes too; here v would be stale
        with pytest.raises(NotImplementedError, match="shares storage"):
            v.numpy()
