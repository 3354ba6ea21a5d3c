"""Composite ops (see composites.py): pixel / channel shuffles, ``prelu``, ``maxout``,
``cosine_embedding_loss``, ``vecdot``, ``dist``, ``rot90``, ``msort``, ``ldexp``, ``numel`` — decomposed into
reshape, transpose, flip, where, sums, maxima and sort (each with an spmd rule)."""
from __future__ import annotations

import math
import numbers

import numpy as np

from spmd_rules.composites import _check_format, _check_reduction, _p, _p_norm, _reduce, gshape


def _factor(op, name, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
        raise ValueError(f"{op}: {name} must be a positive int, got {v!r}")
    return int(v)


def _image_input(op, x, data_format, what, v):
    """(the factor ``what`` = ``v``, x's global shape, paddle) of a 4-D NCHW/NHWC image op; bad input raises."""
    _check_format(op, data_format, ("NCHW", "NHWC"))
    r = _factor(op, what, v)
    s = gshape(x)
    if len(s) != 4:
        raise ValueError(f"{op}: x must be 4-D, got {s}")
    return r, s, _p()


def pixel_shuffle(x, upscale_factor, data_format="NCHW", name=None):
    op = "pixel_shuffle"
    r, s, paddle = _image_input(op, x, data_format, "upscale_factor", upscale_factor)
    if data_format == "NCHW":
        n, c, h, w = s
        if c % (r * r):
            raise ValueError(f"{op}: {c} channels are not divisible by upscale_factor**2 = {r * r}")
        y = paddle.transpose(x.reshape([n, c // (r * r), r, r, h, w]), [0, 1, 4, 2, 5, 3])
        return y.reshape([n, c // (r * r), h * r, w * r])
    n, h, w, c = s
    if c % (r * r):
        raise ValueError(f"{op}: {c} channels are not divisible by upscale_factor**2 = {r * r}")
    y = paddle.transpose(x.reshape([n, h, w, c // (r * r), r, r]), [0, 1, 4, 2, 5, 3])
    return y.reshape([n, h * r, w * r, c // (r * r)])


def pixel_unshuffle(x, downscale_factor, data_format="NCHW", name=None):
    op = "pixel_unshuffle"
    r, s, paddle = _image_input(op, x, data_format, "downscale_factor", downscale_factor)
    n, c, h, w = s if data_format == "NCHW" else (s[0], s[3], s[1], s[2])
    if h % r or w % r:
        raise ValueError(f"{op}: spatial size {[h, w]} is not divisible by downscale_factor {r}")
    if data_format == "NCHW":
        y = paddle.transpose(x.reshape([n, c, h // r, r, w // r, r]), [0, 1, 3, 5, 2, 4])
        return y.reshape([n, c * r * r, h // r, w // r])
    y = paddle.transpose(x.reshape([n, h // r, r, w // r, r, c]), [0, 1, 3, 5, 2, 4])
    return y.reshape([n, h // r, w // r, c * r * r])


def channel_shuffle(x, groups, data_format="NCHW", name=None):
    op = "channel_shuffle"
    g, s, paddle = _image_input(op, x, data_format, "groups", groups)
    if data_format == "NCHW":
        n, c, h, w = s
        if c % g:
            raise ValueError(f"{op}: {c} channels are not divisible by groups={g}")
        return paddle.transpose(x.reshape([n, g, c // g, h, w]), [0, 2, 1, 3, 4]).reshape(s)
    n, h, w, c = s
    if c % g:
        raise ValueError(f"{op}: {c} channels are not divisible by groups={g}")
    return paddle.transpose(x.reshape([n, h, w, g, c // g]), [0, 1, 2, 4, 3]).reshape(s)


def prelu(x, weight, data_format="NCHW", name=None):
    op = "prelu"
    _check_format(op, data_format, ("NC", "NCL", "NCHW", "NCDHW", "NLC", "NHWC", "NDHWC"))
    s, ws = gshape(x), gshape(weight)
    if len(ws) != 1:
        raise ValueError(f"{op}: weight must be 1-D, got {ws}")
    paddle = _p()
    if ws[0] == 1:
        w = weight
    else:
        last = data_format[-1] == "C" and data_format != "NC"
        c = s[-1] if last else s[1]
        if ws[0] != c:
            raise ValueError(f"{op}: weight has {ws[0]} entries, expected 1 or the {c} channels")
        w = weight.reshape([c] if last else [c] + [1] * (len(s) - 2))
    return paddle.where(x > 0, x, w * x)


def maxout(x, groups, axis=1, name=None):
    op = "maxout"
    s = gshape(x)
    if axis not in (1, -1, 3):
        raise ValueError(f"{op}: axis must be 1, -1 or 3, got {axis}")
    a = axis % len(s)
    g = _factor(op, "groups", groups)
    if s[a] % g:
        raise ValueError(f"{op}: {s[a]} channels are not divisible by groups={g}")
    new = s[:a] + [s[a] // g, g] + s[a + 1:]
    return _p().amax(x.reshape(new), axis=a + 1)


def cosine_embedding_loss(input1, input2, label, margin=0, reduction="mean", name=None):
    op = "cosine_embedding_loss"
    _check_reduction(op, reduction)
    if len(gshape(label)) != 1:
        raise ValueError(f"{op}: label must be 1-D, got {gshape(label)}")
    if gshape(input1) != gshape(input2) or len(gshape(input1)) > 2:
        raise ValueError(f"{op}: input1 and input2 must be 1-D or 2-D of one shape, got {gshape(input1)} and "
                         f"{gshape(input2)}")
    paddle = _p()
    prod = (input1 * input2).sum(axis=-1)
    m1 = paddle.square(input1).sum(axis=-1) + 10e-12
    m2 = paddle.square(input2).sum(axis=-1) + 10e-12
    cos = prod / paddle.sqrt(m1 * m2)
    zeros = paddle.zeros_like(cos)
    out = paddle.where(label == 1, 1 - cos, zeros) + paddle.where(label == -1, paddle.clip(cos - margin, min=0), zeros)
    return _reduce(out, reduction)


def gaussian_nll_loss(input, label, variance, full=False, epsilon=1e-06, reduction="mean", name=None):
    op = "gaussian_nll_loss"
    si, sv = gshape(input), gshape(variance)
    if sv != si:
        if si[:-1] == sv:
            variance = variance.unsqueeze(-1)
        elif not (si[:-1] == sv[:-1] and sv[-1] == 1):
            raise ValueError(f"{op}: variance of shape {sv} does not match input {si}")
    _check_reduction(op, reduction)
    paddle = _p()
    if bool(paddle.any(variance < 0)):
        raise ValueError(f"{op}: variance has negative entries")
    variance = paddle.clip(variance.detach(), min=epsilon)     # paddle clamps under no_grad: no variance grad
    loss = 0.5 * (paddle.log(variance) + paddle.square(input - label) / variance)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return _reduce(loss, reduction)


def triplet_margin_loss(input, positive, negative, margin=1.0, p=2, epsilon=1e-06, swap=False, reduction="mean",
                        name=None):
    op = "triplet_margin_loss"
    _check_reduction(op, reduction)
    if margin < 0:
        raise ValueError(f"{op}: margin must be >= 0, got {margin}")
    if not gshape(input) == gshape(positive) == gshape(negative):
        raise ValueError(f"{op}: input, positive and negative must have one shape, got {gshape(input)}, "
                         f"{gshape(positive)} and {gshape(negative)}")
    from spmd_rules.composites import pairwise_distance

    pos = pairwise_distance(input, positive, p, epsilon)
    neg = pairwise_distance(input, negative, p, epsilon)
    if swap:
        neg = _p().minimum(neg, pairwise_distance(positive, negative, p, epsilon))
    return _reduce(_p().clip(pos - neg + margin, min=0.0), reduction)


def multi_margin_loss(input, label, p=1, margin=1.0, weight=None, reduction="mean", name=None):
    op = "multi_margin_loss"
    _check_reduction(op, reduction)
    si = gshape(input)
    if len(si) != 2 or gshape(label)[0] != si[0]:
        raise ValueError(f"{op}: input must be [N, C] and label [N], got {si} and {gshape(label)}")
    paddle = _p()
    label = label.reshape((-1, 1))
    picked = paddle.index_sample(input, label)
    hinge = paddle.pow(paddle.clip(margin - picked + input, min=0.0), p)
    if weight is not None:
        if gshape(weight)[0] != si[1]:
            raise ValueError(f"{op}: weight must have {si[1]} entries, got {gshape(weight)}")
        w = paddle.gather(weight, label, axis=0).reshape((-1, 1))
        loss = paddle.mean(w * hinge, axis=1) - (w * (margin ** p / si[1])).squeeze()
    else:
        loss = paddle.mean(hinge, axis=1) - margin ** p / si[1]
    return _reduce(loss, reduction)


def zeropad2d(x, padding, data_format="NCHW", name=None):
    from spmd_rules.composites import _F

    return _F().pad(x, pad=padding, mode="constant", value=0, data_format=data_format)


def bilinear(x1, x2, weight, bias=None, name=None):
    """out[b, o] = x1[b] @ weight[o] @ x2[b] (+ bias[0, o])."""
    s1, s2, sw = gshape(x1), gshape(x2), gshape(weight)
    if len(s1) != 2 or len(s2) != 2 or len(sw) != 3 or sw[1:] != [s1[1], s2[1]]:
        raise ValueError(f"bilinear: x1 [N, in1], x2 [N, in2] and weight [out, in1, in2] expected, got {s1}, {s2} "
                         f"and {sw}")
    paddle = _p()
    t = paddle.einsum("bi,oij->boj", x1, weight)
    out = paddle.sum(t * x2.unsqueeze(1), axis=-1)
    return out if bias is None else out + bias


def sequence_mask(x, maxlen=None, dtype="int64", name=None):
    paddle = _p()
    if maxlen is None:
        maxlen = int(paddle.max(x))
    elif not isinstance(maxlen, numbers.Integral):
        raise NotImplementedError("sequence_mask: maxlen given as a tensor is not supported on distributed "
                                  "tensors; pass a python int")
    steps = paddle.arange(int(maxlen), dtype=x.dtype)
    out = paddle.cast(steps < x.unsqueeze(-1), dtype)
    out.stop_gradient = True
    return out


def local_response_norm(x, size, alpha=0.0001, beta=0.75, k=1.0, data_format="NCHW", name=None):
    """paddle's own construction (a channel window sum by pad + average pooling) over routed ops."""
    op = "local_response_norm"
    _check_format(op, data_format, ("NCL", "NLC", "NCHW", "NHWC", "NCDHW", "NDHWC"))
    sizes = gshape(x)
    if len(sizes) < 3:
        raise ValueError(f"{op}: expects a 3-D or higher input, got {sizes}")
    paddle, F = _p(), _p().nn.functional
    last = data_format[-1] == "C"
    rest = math.prod(sizes[1:])
    div = paddle.unsqueeze(x * x, axis=1)
    lo, hi = size // 2, (size - 1) // 2
    if len(sizes) == 3:
        div = F.pad(div, pad=[lo, hi, 0, 0] if last else [0, 0, lo, hi])
        div = paddle.squeeze(F.avg_pool2d(div, kernel_size=(1, size) if last else (size, 1), stride=1), axis=1)
    else:
        if last:
            shape5 = [sizes[0], 1, sizes[1], rest // (sizes[1] * sizes[-1]), sizes[-1]]
        else:
            shape5 = [sizes[0], 1, sizes[1], sizes[2], rest // (sizes[1] * sizes[2])]
        div = F.pad(div.reshape(shape5), pad=[lo, hi, 0, 0, 0, 0] if last else [0, 0, 0, 0, lo, hi],
                    data_format="NCDHW")
        div = F.avg_pool3d(div, kernel_size=(1, 1, size) if last else (size, 1, 1), stride=1)
        div = paddle.squeeze(div, axis=1).reshape(sizes)
    return x / paddle.pow(paddle.scale(div, scale=alpha, bias=k), beta)


def vecdot(x, y, axis=-1, name=None):
    return _p().sum(x * y, axis=axis)


def dist(x, y, p=2, name=None):
    d = x - y
    return _p_norm(d, p, None, False)


def rot90(x, k=1, axes=[0, 1], name=None):        # noqa: B006  (paddle's default)
    paddle = _p()
    nd = len(gshape(x))
    if not isinstance(axes, (list, tuple)) or len(axes) != 2:
        raise ValueError(f"rot90: axes must be two ints, got {axes!r}")
    if nd < 2:
        raise ValueError(f"rot90: x must have at least 2 dims, got {gshape(x)}")
    a0, a1 = axes
    if a0 == a1 or abs(a0 - a1) == nd or not (-nd <= a0 < nd and -nd <= a1 < nd):
        raise ValueError(f"rot90: invalid rotation axes {list(axes)} for a {nd}-D tensor")
    k %= 4
    if k == 0:
        return x
    if k == 2:
        return paddle.flip(paddle.flip(x, a0), a1)
    perm = list(range(nd))
    perm[a0], perm[a1] = perm[a1], perm[a0]
    if k == 1:
        return paddle.transpose(paddle.flip(x, a1), perm)
    return paddle.flip(paddle.transpose(x, perm), a1)


def msort(input, *, out=None):
    if out is not None:
        raise NotImplementedError("msort: out= is not supported on distributed tensors; use the result")
    return _p().sort(input, axis=0)


def ldexp(x, y, name=None):
    paddle = _p()
    dt = str(x.dtype).replace("paddle.", "")
    out_dtype = dt if dt in ("float16", "float32", "float64", "bfloat16") else "float32"
    two = paddle.to_tensor(2, dtype=out_dtype)
    return paddle.multiply(paddle.cast(x, out_dtype) if dt != out_dtype else x,
                           paddle.pow(two, paddle.cast(y, out_dtype)))


def numel(x, name=None):
    """The element count as ``x.shape`` reports it, as an int64 scalar tensor: a DistTensor's global count; a
    DistParameter is a paddle Parameter holding this rank's shard, so its count is the shard's, like its
    ``.shape`` and ``.numel()`` (libraries that route ``Tensor.numel`` through ``paddle.numel``, as PaddleFormers
    does, then see the same number)."""
    paddle = _p()
    shape = x.shape if isinstance(x, paddle.Tensor) else gshape(x)
    return paddle.to_tensor(math.prod(shape), dtype="int64")


# ---- random tensors like x: one draw for the global shape (as one process makes it), laid out like x -----------------
def _random_like(op, x, dtype, draw, device=None, requires_grad=False):
    if device is not None:
        raise NotImplementedError(f"{op}: device= is not supported on distributed tensors")
    base = _p().zeros_like(x, dtype=dtype)         # x's layout (Partial -> R); the values of x are not read
    out = base + draw(gshape(x), str(base.dtype).replace("paddle.", ""))
    out.stop_gradient = not requires_grad
    return out


def rand_like(input, name=None, *, dtype=None, device=None, requires_grad=False):
    return _random_like("rand_like", input, dtype, lambda s, dt: _p().rand(s, dtype=dt), device, requires_grad)


def randn_like(x, dtype=None, name=None, *, device=None, requires_grad=False):
    return _random_like("randn_like", x, dtype, lambda s, dt: _p().randn(s, dtype=dt), device, requires_grad)


def randint_like(x, low=0, high=None, dtype=None, name=None):
    if high is None:
        low, high = 0, low
    if low >= high:
        raise ValueError(f"randint_like: low must be < high, got low={low}, high={high}")
    return _random_like("randint_like", x, dtype,
                        lambda s, dt: _p().randint(low, high, s).astype(dt))


def multinomial(x, num_samples=1, replacement=False, name=None):
    """``paddle.multinomial`` over distributed probabilities (sampling in ``generate``): ONE draw from the
    global probabilities, as one process makes it, on every rank from the generator state they share; the
    samples come back whole (a plain tensor: replicated next to distributed operands)."""
    probs = x.full() if hasattr(x, "full") else x
    return _p().multinomial(probs.detach(), num_samples=num_samples, replacement=replacement)


def affine_grid(theta, out_shape, align_corners=True, name=None):
    """``F.affine_grid`` (spatial transformers): the normalised base grid, a constant, times ``theta``'s
    transpose -- a batched matmul, so a batch-split ``theta`` gives a batch-split grid."""
    paddle = _p()
    size = [int(v) for v in (out_shape.tolist() if hasattr(out_shape, "tolist") else out_shape)]
    s = gshape(theta)
    nsp = len(size) - 2
    if nsp not in (2, 3) or list(s) != [size[0], nsp, nsp + 1]:
        raise ValueError(f"affine_grid: theta must be [N, {nsp}, {nsp + 1}] for out_shape {size} (N = out_shape[0]), "
                         f"got {list(s)}")
    axes = []
    for n in reversed(size[2:]):                      # x (width) first, as paddle orders the coordinates
        a = np.linspace(-1.0, 1.0, n) if n > 1 else np.zeros(1)
        axes.append(a if align_corners else a * (n - 1) / n)
    mesh = np.meshgrid(*axes[::-1], indexing="ij")[::-1]  # over (D,) H, W; coordinates ordered x, y(, z)
    base = np.stack(mesh + [np.ones_like(mesh[0])], axis=-1).reshape(1, -1, nsp + 1)
    base = paddle.to_tensor(base.astype(str(theta.dtype).replace("paddle.", "")))
    grid = paddle.matmul(base, theta, transpose_y=True)
    return grid.reshape([size[0], *size[2:], nsp])


def _with_axis(kind):
    """paddle's private ``_add/_subtract/_multiply/_divide_with_axis(x, y, axis)`` (weight_norm's ``g * v``, the
    conv bias add, RNN state masks): ``y`` laid along x's dims from ``axis`` on, then the elementwise op."""
    def fn(x, y, axis=-1, name=None):
        xs, ys = gshape(x), gshape(y)
        if axis != -1 and len(xs) != len(ys):
            if len(xs) > len(ys):
                y = y.reshape([1] * axis + list(ys) + [1] * (len(xs) - len(ys) - axis))
            else:
                x = x.reshape([1] * axis + list(xs) + [1] * (len(ys) - len(xs) - axis))
        return getattr(_p(), kind)(x, y)

    fn.__name__ = f"_{kind}_with_axis"
    return fn


_P_NAMES = ("vecdot", "dist", "rot90", "msort", "ldexp", "numel", "rand_like", "randn_like", "randint_like",
            "multinomial")
COMPOSITES: dict = {f"paddle.nn.functional.{n}": globals()[n]
                    for n in ("pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "prelu", "maxout",
                              "cosine_embedding_loss", "gaussian_nll_loss", "triplet_margin_loss",
                              "multi_margin_loss", "zeropad2d", "bilinear", "sequence_mask",
                              "local_response_norm", "affine_grid")}
COMPOSITES.update({f"paddle.{n}": globals()[n] for n in _P_NAMES})
COMPOSITES["paddle.linalg.vecdot"] = vecdot
COMPOSITES.update({f"paddle.tensor.math._{k}_with_axis": _with_axis(k) for k in ("add", "subtract", "multiply",
                                                                                   "divide")})
