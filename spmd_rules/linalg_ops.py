"""Per-matrix linear algebra of ``paddle.linalg``: ``inv`` (``paddle.inverse``), ``det``, ``slogdet``, ``cholesky``,
``qr``, ``svd``, ``svdvals``, ``eigh``, ``eigvalsh``, ``matrix_power``, ``matrix_exp``, ``pinv``, ``solve``,
``triangular_solve``, ``cholesky_solve``, ``matrix_rank``, ``cond``, ``cholesky_inverse``, ``householder_product``,
``ormqr``, ``lu``, ``lu_unpack``, ``lu_solve``, ``eig`` and ``eigvals`` (complex outputs: complex64 of float32,
complex128 of float64).

Every input whole and every output replicated: each rank runs paddle's own decomposition on the whole matrices, so
the values (and the signs of singular / eigen vectors, which LAPACK fixes for given input) are one process's. None
is linear: a Partial input is reduced first. The rules are shape functions: they give each output's global shape."""
from __future__ import annotations

from autoparallel.core.spec import DistSpec

from spmd_rules.einsum import labels_result
from spmd_rules.registry import register_spmd_rule
from spmd_rules.utils import COMPLEX_OF, check_spec, int_arg, promote

_FLOATS = ("float32", "float64")


def _matrices(op, x, square=False):
    """x's batch shape, rows, cols (x must be a batch of matrices; ``square``: of square ones)."""
    check_spec(op, "x", x)
    if x.ndim < 2:
        raise ValueError(f"{op}: x must have rank >= 2 (a batch of matrices), got shape {list(x.shape)}")
    m, n = x.shape[-2], x.shape[-1]
    if square and m != n:
        raise ValueError(f"{op}: x must be a batch of square matrices, got shape {list(x.shape)}")
    return tuple(x.shape[:-2]), m, n


def _whole(op, specs, metas):
    """Every input whole, every output (global shape, dtype) replicated."""
    specs = [s for s in specs if isinstance(s, DistSpec)]
    return labels_result(op, specs, [(None,) * s.ndim for s in specs], [(None,) * len(shape) for shape, _ in metas],
                         metas, linear=None)


def _float(dtype):
    return dtype if dtype in _FLOATS else "float32"


def _same_shape(op, x):
    """A batch of square matrices in, one of the same shape out."""
    _matrices(op, x, square=True)
    return _whole(op, [x], [(x.shape, x.dtype)])


@register_spmd_rule("inv")
def inv(x, name=None):
    return _same_shape("inv", x)


@register_spmd_rule("cholesky")
def cholesky(x, upper=False, name=None):
    return _same_shape("cholesky", x)


@register_spmd_rule("matrix_exp")
def matrix_exp(x, name=None):
    return _same_shape("matrix_exp", x)


@register_spmd_rule("matrix_power")
def matrix_power(x, n, name=None):
    int_arg("matrix_power", "n", n)
    return _same_shape("matrix_power", x)


@register_spmd_rule("det")
def det(x, name=None):
    batch, _, _ = _matrices("det", x, square=True)
    return _whole("det", [x], [(batch, x.dtype)])


@register_spmd_rule("slogdet")
def slogdet(x, name=None):
    """paddle 3.3 stacks sign and log|det| into one tensor of shape [2, *batch]."""
    batch, _, _ = _matrices("slogdet", x, square=True)
    return _whole("slogdet", [x], [((2,) + batch, x.dtype)])


@register_spmd_rule("qr")
def qr(x, mode="reduced", name=None):
    batch, m, n = _matrices("qr", x)
    k = min(m, n)
    if mode == "reduced":
        return _whole("qr", [x], [(batch + (m, k), x.dtype), (batch + (k, n), x.dtype)])
    if mode == "complete":
        return _whole("qr", [x], [(batch + (m, m), x.dtype), (batch + (m, n), x.dtype)])
    if mode == "r":
        return _whole("qr", [x], [(batch + (k, n), x.dtype)])
    raise ValueError(f"qr: mode must be 'reduced', 'complete' or 'r', got {mode!r}")


@register_spmd_rule("svd")
def svd(x, full_matrices=False, name=None, *, out=None):
    if out is not None:
        raise NotImplementedError("svd: out= is not supported on distributed tensors")
    batch, m, n = _matrices("svd", x)
    k = min(m, n)
    u, vh = ((m, m), (n, n)) if full_matrices else ((m, k), (k, n))
    return _whole("svd", [x], [(batch + u, x.dtype), (batch + (k,), x.dtype), (batch + vh, x.dtype)])


@register_spmd_rule("svdvals")
def svdvals(x, name=None):
    batch, m, n = _matrices("svdvals", x)
    return _whole("svdvals", [x], [(batch + (min(m, n),), x.dtype)])


def _uplo(op, UPLO):
    if UPLO not in ("L", "U"):
        raise ValueError(f"{op}: UPLO must be 'L' or 'U', got {UPLO!r}")


@register_spmd_rule("eigh")
def eigh(x, UPLO="L", name=None):
    _uplo("eigh", UPLO)
    batch, n, _ = _matrices("eigh", x, square=True)
    return _whole("eigh", [x], [(batch + (n,), _float(x.dtype)), (x.shape, x.dtype)])


@register_spmd_rule("eig")
def eig(x, name=None):
    batch, n, _ = _matrices("eig", x, square=True)
    dtype = COMPLEX_OF.get(x.dtype, x.dtype)
    return _whole("eig", [x], [(batch + (n,), dtype), (x.shape, dtype)])


@register_spmd_rule("eigvals")
def eigvals(x, name=None):
    batch, n, _ = _matrices("eigvals", x, square=True)
    return _whole("eigvals", [x], [(batch + (n,), COMPLEX_OF.get(x.dtype, x.dtype))])


@register_spmd_rule("eigvalsh")
def eigvalsh(x, UPLO="L", name=None):
    _uplo("eigvalsh", UPLO)
    batch, n, _ = _matrices("eigvalsh", x, square=True)
    return _whole("eigvalsh", [x], [(batch + (n,), _float(x.dtype))])


@register_spmd_rule("pinv")
def pinv(x, rcond=1e-15, hermitian=False, name=None):
    batch, m, n = _matrices("pinv", x)
    return _whole("pinv", [x, rcond], [(batch + (n, m), x.dtype)])


def _system(op, x, y):
    """A system x · out = y: x a batch of square matrices, y its right-hand sides (out has y's shape)."""
    _matrices(op, x, square=True)
    check_spec(op, "y", y)
    rows = y.shape[-1] if y.ndim == x.ndim - 1 else (y.shape[-2] if y.ndim >= 2 else -1)     # vectors or matrices
    if rows != x.shape[-1]:
        raise ValueError(f"{op}: y of shape {list(y.shape)} does not match x of shape {list(x.shape)}")
    return _whole(op, [x, y], [(y.shape, promote(x.dtype, y.dtype))])


@register_spmd_rule("solve")
def solve(x, y, left=True, name=None, *, out=None):
    if out is not None:
        raise NotImplementedError("solve: out= is not supported on distributed tensors")
    if not left:
        _matrices("solve", x, square=True)
        check_spec("solve", "y", y)
        return _whole("solve", [x, y], [(y.shape, promote(x.dtype, y.dtype))])
    return _system("solve", x, y)


@register_spmd_rule("triangular_solve")
def triangular_solve(x, y, upper=True, transpose=False, unitriangular=False, name=None):
    return _system("triangular_solve", x, y)


@register_spmd_rule("cholesky_solve")
def cholesky_solve(x, y, upper=False, name=None):
    """paddle's argument order: ``x`` the right-hand sides, ``y`` the Cholesky factor; out has x's shape."""
    check_spec("cholesky_solve", "x", x)
    _matrices("cholesky_solve", y, square=True)
    return _whole("cholesky_solve", [x, y], [(x.shape, promote(x.dtype, y.dtype))])


@register_spmd_rule("matrix_rank")
def matrix_rank(x, tol=None, hermitian=False, atol=None, rtol=None, name=None):
    batch, _, _ = _matrices("matrix_rank", x)
    return _whole("matrix_rank", [x, tol, atol, rtol], [(batch, "int64")])


@register_spmd_rule("cond")
def cond(x, p=None, name=None):
    batch, _, _ = _matrices("cond", x, square=p not in (None, 2, -2))
    return _whole("cond", [x], [(batch, _float(x.dtype))])


@register_spmd_rule("cholesky_inverse")
def cholesky_inverse(x, upper=False, name=None):
    _matrices("cholesky_inverse", x, square=True)
    return _whole("cholesky_inverse", [x], [(x.shape, x.dtype)])


@register_spmd_rule("householder_product")
def householder_product(x, tau, name=None):
    _matrices("householder_product", x)
    check_spec("householder_product", "tau", tau)
    return _whole("householder_product", [x, tau], [(x.shape, x.dtype)])


@register_spmd_rule("ormqr")
def ormqr(x, tau, y, left=True, transpose=False, name=None):
    _matrices("ormqr", x)
    check_spec("ormqr", "tau", tau)
    check_spec("ormqr", "y", y)
    return _whole("ormqr", [x, tau, y], [(y.shape, y.dtype)])


@register_spmd_rule("lu")
def lu(x, pivot=True, get_infos=False, name=None):
    batch, m, n = _matrices("lu", x)
    metas = [(x.shape, x.dtype), (batch + (min(m, n),), "int32")] + ([(batch, "int32")] if get_infos else [])
    return _whole("lu", [x], metas)


@register_spmd_rule("lu_unpack")
def lu_unpack(x, y, unpack_ludata=True, unpack_pivots=True, name=None):
    batch, m, n = _matrices("lu_unpack", x)
    check_spec("lu_unpack", "y", y)
    if not (unpack_ludata and unpack_pivots):
        raise NotImplementedError("lu_unpack: unpack_ludata=False / unpack_pivots=False on distributed tensors are "
                                  "not supported (paddle returns placeholder tensors there); unpack both")
    k = min(m, n)
    return _whole("lu_unpack", [x, y], [(batch + (m, m), x.dtype), (batch + (m, k), x.dtype),
                                        (batch + (k, n), x.dtype)])


@register_spmd_rule("lu_solve")
def lu_solve(b, lu, pivots, trans="N", name=None):
    check_spec("lu_solve", "b", b)
    _matrices("lu_solve", lu, square=True)
    check_spec("lu_solve", "pivots", pivots)
    return _whole("lu_solve", [b, lu, pivots], [(b.shape, promote(b.dtype, lu.dtype))])
