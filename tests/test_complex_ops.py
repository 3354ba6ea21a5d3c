"""Complex numbers on distributed tensors, against paddle on the whole tensor (values and every real input's
gradient): ``as_complex`` / ``view_as_complex``, ``as_real`` / ``view_as_real``, ``real``, ``imag``, ``conj``,
``angle``, ``complex``, ``polar``, ``abs``, ``linalg.eig`` / ``eigvals`` and a rotary embedding written with complex numbers (pairs -> complex, times a
complex ``freqs_cis``, back to real) over every layout of the sweep. They had no rule. Real gloo ranks:
tests/test_complex_ops_dist.py."""
import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.comm.transport import _complex_op
from layout_sweep_helpers import failures, placements, x as _x

pytestmark = pytest.mark.sim

FREQS = np.random.default_rng(5).standard_normal((6, 2)).astype("float32")


def rope(a):
    """[B, S, H, D]: the last dim paired into D/2 complex numbers, rotated by freqs_cis [S, D/2], back to real."""
    b, s, h, d = a.shape
    pairs = paddle.as_complex(a.reshape([b, s, h, d // 2, 2]))
    freqs_cis = paddle.polar(paddle.ones([s, d // 2]), paddle.to_tensor(FREQS))
    return paddle.as_real(pairs * freqs_cis.reshape([1, s, 1, d // 2])).reshape([b, s, h, d])


CASES = {
    "rope": (rope, [_x(2, 6, 4, 4)], None),
    "real imag": (lambda a: paddle.real(paddle.as_complex(a)) * 2 + paddle.as_complex(a).imag(), [_x(4, 6, 2)], None),
    "conj": (lambda a: paddle.as_real(paddle.as_complex(a).conj()), [_x(4, 6, 2)], None),
    "angle": (lambda a: paddle.angle(paddle.as_complex(a)), [_x(4, 6, 2)], None),
    "complex": (lambda a, b: paddle.as_real(paddle.complex(a, b)), [_x(4, 6), _x(4, 6, seed=2)], None),
    "polar": (lambda a, b: paddle.as_real(paddle.polar(a.abs(), b)), [_x(4, 6), _x(4, 6, seed=2)], None),
    "view": (lambda a: paddle.view_as_real(paddle.view_as_complex(a) * 2), [_x(4, 6, 2)], None),
    "abs": (lambda a: paddle.abs(paddle.as_complex(a)), [_x(4, 6, 2)], None),
    "eigvals": (lambda a: paddle.linalg.eigvals(a).abs(), [_x(3, 4, 4)], None),
    "eig": (lambda a: paddle.real(paddle.linalg.eig(a)[0]) + paddle.linalg.eig(a)[1].abs().sum(-1), [_x(3, 4, 4)],
            None),
}


@pytest.mark.parametrize("kind", ["S0", "S1", "S2", "P", "S0,Slast", "P,S0", "Slast,P"])
def test_complex_ops_match_the_whole_tensor(kind):
    assert failures(CASES, kind) == []


def test_the_pair_dim_is_gathered_and_bad_inputs_are_named():
    a = _x(4, 6, 2)
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        x = ap.shard_tensor(paddle.to_tensor(a), mesh, [ap.Shard(2)])        # the (real, imag) dim split
        c = paddle.as_complex(x)
        assert c.placements == [ap.Replicate()] and c.dtype == paddle.complex64
        assert np.allclose(c.numpy(), a[..., 0] + 1j * a[..., 1])
        with pytest.raises(ValueError, match=r"the last dim of x must have size 2 .*got shape \[4, 6\]"):
            paddle.as_complex(ap.shard_tensor(paddle.to_tensor(_x(4, 6)), mesh, [ap.Shard(0)]))
        with pytest.raises(TypeError, match="expects a complex64 or complex128 tensor, got float32"):
            paddle.as_real(x)
        y = ap.shard_tensor(paddle.to_tensor(_x(4, 6)), mesh, [ap.Shard(0)])
        with pytest.raises(NotImplementedError, match=r"same shape .* got \[4, 6\] and \[6\]"):
            paddle.gammainc(y.abs(), paddle.ones([6]))
    with pytest.raises(NotImplementedError, match="complex numbers have no order"):
        _complex_op("all_reduce", "max")


def test_complex_shards_reshard_in_the_simulated_world():
    a = _x(4, 6, 2)
    want = a[..., 0] + 1j * a[..., 1]
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["a", "b"])
        c = paddle.as_complex(ap.shard_tensor(paddle.to_tensor(a), mesh, placements("S0,S0", 3)))
        for target in ([ap.Shard(1), ap.Replicate()], [ap.Replicate(), ap.Shard(0)]):
            assert np.allclose(ap.reshard(c, mesh, target).numpy(), want)
