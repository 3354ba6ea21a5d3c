"""Complex numbers on distributed tensors, against paddle on the whole tensor (values and every real input's
gradient): ``as_complex`` / ``view_as_complex``, ``as_real`` / ``view_as_real``, ``real``, ``imag``, ``conj``,
``angle``, ``complex``, ``polar``, ``abs``, ``linalg.eig`` / ``eigvals``, the ``paddle.fft`` transforms and a rotary
embedding written with complex numbers (pairs -> complex, times a complex ``freqs_cis``, back to real) over every
layout of the sweep. They had no rule. Real gloo ranks: tests/test_complex_ops_dist.py."""
import numpy as np
import paddle
import pytest

import paddle.fft as fft

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


def _real(t):
    return paddle.as_real(t) if t.dtype in (paddle.complex64, paddle.complex128) else t


FFT = {
    "fft": (lambda a: _real(fft.fft(a)), [_x(4, 6, 8)], None),
    "fft n axis ortho": (lambda a: _real(fft.fft(a, n=5, axis=1, norm="ortho")), [_x(4, 6, 8)], None),
    "ifft": (lambda a: _real(fft.ifft(a, axis=0)), [_x(4, 6, 8)], None),
    "rfft": (lambda a: _real(fft.rfft(a)), [_x(4, 6, 8)], None),
    "irfft": (lambda a: fft.irfft(fft.rfft(a), n=8), [_x(4, 6, 8)], None),
    "irfft default n": (lambda a: fft.irfft(fft.fft(a)), [_x(4, 6, 8)], None),
    "hfft": (lambda a: fft.hfft(fft.fft(a), axis=1), [_x(4, 6, 8)], None),
    "ihfft": (lambda a: _real(fft.ihfft(a, n=6)), [_x(4, 6, 8)], None),
    "fft2": (lambda a: _real(fft.fft2(a)), [_x(4, 6, 8)], None),
    "rfft2 axes": (lambda a: _real(fft.rfft2(a, axes=(0, 2))), [_x(4, 6, 8)], None),
    "irfftn": (lambda a: fft.irfftn(fft.rfftn(a), s=(6, 8), axes=(1, 2)), [_x(4, 6, 8)], None),
    "fftn s": (lambda a: _real(fft.fftn(a, s=(3, 5))), [_x(4, 6, 8)], None),
    "fftshift": (lambda a: fft.fftshift(a, axes=(1, 2)) + fft.ifftshift(a), [_x(4, 6, 8)], None),
}


@pytest.mark.parametrize("kind", ["S0", "S1", "S2", "P", "S0,Slast", "P,S0"])
def test_fourier_transforms_match_the_whole_tensor(kind):
    """The transformed axes whole, the others kept; a Partial input stays Partial (the transform is linear)."""
    assert failures(FFT, kind) == []


def test_a_partial_input_is_transformed_without_communication_and_bad_arguments_are_named():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        x = ap.shard_tensor(paddle.to_tensor(_x(4, 8)), mesh, [ap.Partial()])
        assert fft.rfft(x).placements == [ap.Partial()]
        y = ap.shard_tensor(paddle.to_tensor(_x(4, 8)), mesh, [ap.Shard(1)])
        assert fft.fft(y, axis=0).placements == [ap.Shard(1)]
        with pytest.raises(ValueError, match="norm must be one of"):
            fft.fft(y, norm="unitary")
        with pytest.raises(TypeError, match="rfft: expects a real tensor, got complex64"):
            fft.rfft(fft.fft(y))
        with pytest.raises(NotImplementedError, match=r"paddle.signal.stft has no spmd rule"):
            paddle.signal.stft(y, 4)                     # guarded: paddle.signal, paddle.geometric, paddle.vision.ops
