"""The sample calls of every built-in rule, and the paddle callables some ops are checked against."""
from __future__ import annotations

import numpy as np

from .case import IMPLS, T, _COUNTER, add_case, f, ints
from .local_arrays import _paddle, _rng

_BUILT = False


def _build_cases():
    global _BUILT
    if _BUILT:
        return
    _BUILT = True
    _COUNTER[0] = 0
    _impls()
    from .samples_fused import cases_fused
    from .samples_vl import cases_multimodal
    from .samples_bitwise import cases_bitwise
    for build in (cases_multimodal, _cases_matmul, _cases_elementwise, _cases_reduction, _cases_norm, _cases_nn, _cases_shape,
                  _cases_creation, _cases_optimizer, _cases_routing, _cases_more, _cases_blocks,
                  _cases_elementwise_more, _cases_math_more, _cases_pooling, _cases_special,
                  _cases_interpolate, cases_fused, cases_bitwise):
        build()


def blocked(t: T, **dims) -> T:
    """``t`` also tried block-sharded: ``blocked(f(4, 18), d1=(12, 6))``."""
    t.blocks = {int(k[1:]): tuple(v) for k, v in dims.items()}
    return t


def _cases_blocks():
    """Fused projections: blocks divisible by 2 and 3 (both 1-d meshes), aligned and misaligned pieces."""
    add_case("linear", f(2, 3, 6), blocked(f(6, 18), d1=(12, 6)), blocked(f(18), d0=(12, 6)), label="fused")
    add_case("matmul", f(3, 6), blocked(f(6, 12), d1=(6, 6)), label="fused")
    add_case("chunk", blocked(f(4, 12), d1=(6, 6)), 2, axis=-1, label="fused")
    add_case("chunk", blocked(f(4, 12), d1=(6, 6)), 3, axis=-1, label="misaligned")
    add_case("split", blocked(f(4, 18), d1=(6, 6, 6)), [12, 6], axis=1, label="fused")
    add_case("split", blocked(f(4, 18), d1=(12, 6)), [6, 12], axis=1, label="misaligned")
    add_case("getitem", blocked(f(2, 18), d1=(6, 6, 6)), (Ellipsis, slice(0, 6)), label="block-q")
    add_case("getitem", blocked(f(2, 18), d1=(6, 6, 6)), (Ellipsis, slice(6, None)), label="block-kv")
    add_case("getitem", blocked(f(2, 18), d1=(6, 6, 6)), (Ellipsis, slice(3, 9)), label="block-misaligned")
    add_case("multiply", blocked(f(4, 12), d1=(6, 6)), blocked(f(4, 12), d1=(6, 6)), label="fused")
    add_case("add", blocked(f(4, 12), d1=(6, 6)), blocked(f(12), d0=(6, 6)), label="fused-broadcast")
    add_case("silu", blocked(f(4, 12), d1=(6, 6)), label="fused")
    add_case("transpose", blocked(f(4, 12), d1=(6, 6)), [1, 0], label="fused")
    add_case("softmax", blocked(f(4, 12), d1=(6, 6)), axis=0, label="fused-other-axis")
    add_case("softmax", blocked(f(4, 12), d1=(6, 6)), axis=1, label="fused-axis")
    add_case("sum", blocked(f(4, 12), d1=(6, 6)), axis=1, label="fused-reduced")
    add_case("mean", blocked(f(4, 12), d1=(6, 6)), axis=1, label="fused-reduced")
    add_case("mean", blocked(f(4, 12), d1=(6, 6)), axis=0, label="fused-kept")
    add_case("max", blocked(f(4, 12), d1=(6, 6)), axis=1, label="fused-reduced")
    add_case("argmax", blocked(f(4, 12), d1=(6, 6)), axis=1, label="fused-unaware")
    add_case("sgd", blocked(T(f(4, 12).array, partial=False, grad=False), d1=(6, 6)),
             T(np.array([0.1]), shard=False, grad=False),
             blocked(T(f(4, 12).array, grad=False), d1=(6, 6)), label="fused")
    add_case("reshape", blocked(f(4, 12), d1=(6, 6)), [4, 2, 6], label="fused-split")
    add_case("reshape", blocked(f(2, 3, 12), d2=(6, 6)), [6, 12], label="fused-kept")
    add_case("flatten", blocked(f(2, 3, 12), d2=(6, 6)), start_axis=0, stop_axis=1, label="fused-kept")
    add_case("flatten", blocked(f(2, 12, 3), d1=(6, 6)), start_axis=1, label="fused-merged")


def _impls():
    paddle = _paddle()
    from autoparallel.compat import C_OPS
    F = paddle.nn.functional

    def rms_norm(x, normalized_shape, weight=None, eps=1e-05, name=None):
        k = len(normalized_shape) if isinstance(normalized_shape, (list, tuple)) else 1
        axes = list(range(x.ndim - k, x.ndim))
        inv = paddle.rsqrt((x * x).mean(axis=axes, keepdim=True) + eps)
        out = x * inv
        if weight is not None:
            out = out * weight.reshape(x.shape[x.ndim - k:])
        return out, inv.reshape([-1]).astype("float32")

    def rotary_embedding(x, cos, sin):
        x1, x2 = paddle.chunk(x, 2, axis=-1)
        return x * cos + paddle.concat([-x2, x1], axis=-1) * sin

    def sgd(param, learning_rate, grad, master_param=None, multi_precision=False):
        p = param.clone()
        out = C_OPS.sgd_(p, learning_rate, grad, master_param, multi_precision)
        return out

    def adamw(param, grad, learning_rate, moment1, moment2, moment2_max, beta1_pow, beta2_pow, master_weight,
              found_inf, *rest, **kw):
        c = [None if t is None else t.clone() for t in (param, moment1, moment2, moment2_max, beta1_pow, beta2_pow,
                                                          master_weight)]
        out = C_OPS.adamw_(c[0], grad, learning_rate, c[1], c[2], c[3], c[4], c[5], c[6], found_inf,
                                   *rest, *kw.values())
        return tuple(out)

    def batch_norm(x, running_mean, running_var, *args, **kwargs):
        return F.batch_norm(x, running_mean.clone(), running_var.clone(), *args, **kwargs)

    def setitem(x, index, value):
        y = x.clone()
        y[index] = value
        return y

    def fill_diagonal_(x, value, offset=0, wrap=False, name=None):      # paddle's in-place form, on a copy
        y = x.clone()
        y.fill_diagonal_(value, offset, wrap)
        return y

    IMPLS.update(setitem=setitem, fill_diagonal_=fill_diagonal_)
    IMPLS.update(rms_norm=rms_norm, rotary_embedding=rotary_embedding, sgd=sgd, adamw=adamw, batch_norm=batch_norm)


def _cases_matmul():
    add_case("matmul", f(5, 6), f(6, 7))
    add_case("matmul", f(2, 3, 5), f(7, 5), transpose_y=True, label="batched-transpose_y")
    add_case("matmul", f(6, 5), f(6, 7), transpose_x=True, label="transpose_x")
    add_case("matmul", f(3, 1, 5, 6), f(1, 2, 6, 5), label="broadcast-batch")
    add_case("matmul", f(6), f(6, 5), label="vector")
    add_case("linear", f(2, 5, 6), f(6, 7), f(7))
    add_case("linear", f(5, 6), f(6, 7), label="no-bias")
    add_case("bmm", f(3, 5, 6), f(3, 6, 2))
    add_case("einsum", "bij,bjk->bik", f(2, 5, 6), f(2, 6, 3))
    add_case("einsum", "bshd,bthd->bhst", f(2, 3, 2, 5), f(2, 5, 2, 5), label="attention-scores")
    add_case("einsum", "ij->j", f(5, 3), label="reduce")
    add_case("einsum", "...ij,jk->...ik", f(2, 5, 6), f(6, 3), label="ellipsis")
    add_case("einsum", "bii->bi", f(3, 4, 4), label="diagonal")
    add_case("einsum", "ii,i->i", f(4, 4), f(4), label="diagonal-product")
    add_case("einsum", "bij,bjj->bi", f(2, 3, 4), f(2, 4, 4), label="diagonal-contraction")


def _cases_elementwise():
    for op in ("exp", "tanh", "sigmoid", "erf", "sin", "cos", "silu", "relu", "abs", "square", "neg", "clone",
               "gelu"):
        add_case(op, f(5, 6))
    for op in ("log", "sqrt", "rsqrt", "log1p"):
        add_case(op, f(5, 6, lo=0.5))
    add_case("floor", f(5, 3), grad=False)
    add_case("sign", f(5, 3), grad=False)
    add_case("leaky_relu", f(5, 3), negative_slope=0.1)
    add_case("clip", f(5, 3), min=-0.5, max=0.5)
    add_case("pow", f(5, 3, lo=0.5), 3.0)
    add_case("pow", f(5, 3, lo=0.5), f(3), label="tensor-exponent")
    add_case("scale", f(5, 3), scale=2.0)
    add_case("scale", f(5, 3), scale=2.0, bias=1.0, label="bias")
    add_case("cast", f(5, 3), "float32", rtol=1e-6, atol=1e-6)
    add_case("cast", f(5, 3), "int64", label="to-int", grad=False)
    add_case("logical_not", T(_rng("b", 0).random((5, 3)) > 0.5))
    for op in ("add", "subtract", "multiply", "divide", "maximum", "minimum"):
        add_case(op, f(5, 6), f(6))
        add_case(op, f(5, 1, 6), f(3, 6, lo=0.5), label="broadcast")
    add_case("add", f(5, 6), 2.5, label="scalar", impl=lambda x, y: x + y)
    add_case("add", f(5, 6), f(5, 6), alpha=2.0, label="alpha")
    add_case("divide", f(5, 6), f(6, lo=0.5), rounding_mode="floor", label="floor", grad=False)
    add_case("subtract", 2.5, f(5, 6), label="scalar-first", impl=lambda x, y: x - y)
    add_case("multiply", f(5, 6), 2.5, label="scalar", impl=lambda x, y: x * y)
    add_case("divide", 3.0, f(5, 6, lo=0.5), label="scalar-numerator", impl=lambda x, y: x / y)
    add_case("divide", f(5, 6), 4.0, label="scalar-denominator", impl=lambda x, y: x / y)
    add_case("floor_divide", ints(9, 5, 3, low=1), ints(4, 3, low=1))
    add_case("remainder", ints(9, 5, 3), ints(4, 3, low=1))
    for op in ("equal", "not_equal", "less_than", "less_equal", "greater_than", "greater_equal"):
        add_case(op, f(5, 6), f(6))
    bools = T(_rng("b", 1).random((5, 6)) > 0.5)
    add_case("logical_and", bools, T(_rng("b", 2).random((6,)) > 0.5))
    add_case("logical_or", bools, T(_rng("b", 3).random((5, 6)) > 0.5))
    add_case("where", bools, f(5, 6), f(6))
    add_case("where", bools, f(5, 6), 0.0, label="scalar-y")


def _cases_reduction():
    for op in ("sum", "mean", "max", "min"):
        add_case(op, f(5, 6, 7), axis=1)
        add_case(op, f(5, 6), label="all")
        add_case(op, f(5, 6, 7), axis=[0, 2], keepdim=True, label="axes-keepdim")
    add_case("mean", f(5, 6), axis=1, dtype="float32", label="dtype", rtol=1e-6, atol=1e-6)
    add_case("sum", f(5, 6), axis=-1, dtype="float32", label="dtype", rtol=1e-6, atol=1e-6)
    for op in ("argmax", "argmin"):
        add_case(op, f(5, 6, 7), axis=1)
        add_case(op, f(5, 6), axis=-1, keepdim=True, label="keepdim")
        add_case(op, f(5, 6), label="flat")


def _cases_norm():
    for op in ("softmax", "log_softmax"):
        add_case(op, f(5, 6, 7))
        add_case(op, f(5, 6), axis=0, label="axis0")
    add_case("layer_norm", f(2, 5, 6), 6, f(6), f(6))
    add_case("layer_norm", f(5, 3, 4), [3, 4], label="two-dims-no-affine")
    add_case("rms_norm", f(5, 3, 6), [6], f(6))
    add_case("rms_norm", f(6, 5), [5], label="2d")
    stats = dict(partial=False, grad=False)
    add_case("batch_norm", f(5, 6, 3, 3), T(f(6).array, **stats), T(f(6, lo=0.5).array, **stats), f(6), f(6),
             label="eval")
    add_case("batch_norm", f(5, 6, 3, 3), T(f(6).array, **stats), T(f(6, lo=0.5).array, **stats), f(6), f(6),
             training=True, label="train")
    add_case("conv2d", f(5, 6, 4, 4), f(7, 6, 3, 3), f(7), padding=1)
    add_case("conv2d", f(5, 4, 4, 6), f(7, 6, 2, 2), stride=2, data_format="NHWC", label="nhwc")
    add_case("conv1d", f(5, 6, 8), f(4, 6, 3), f(4), padding=[2, 0], label="causal")
    add_case("conv1d", f(5, 6, 8), f(6, 1, 3), f(6), padding=2, groups=6, label="depthwise")
    add_case("conv1d", f(5, 8, 6), f(4, 6, 2), stride=2, padding="SAME", data_format="NLC", label="nlc")
    add_case("conv3d", f(3, 4, 4, 4, 5), f(6, 4, 2, 3, 2), f(6), padding=1)
    add_case("conv2d_transpose", f(5, 6, 3, 3), f(6, 4, 2, 2), f(4), stride=2)
    add_case("conv2d_transpose", f(5, 3, 3, 6), f(6, 4, 3, 3), padding=1, output_padding=1, stride=2,
             data_format="NHWC", label="nhwc")
    add_case("conv2d_transpose", f(5, 3, 3, 6), f(6, 4, 3, 3), f(4), padding="SAME", stride=2,
             data_format="NHWC", label="same")
    add_case("conv2d_transpose", f(5, 6, 3, 3), f(6, 2, 3, 3), stride=2, output_size=[8, 8], groups=2,
             dilation=1, label="groups-size")
    add_case("conv1d_transpose", f(5, 6, 4), f(6, 3, 3), f(3), stride=2, padding=1, label="1d")
    add_case("conv3d_transpose", f(3, 4, 2, 3, 2), f(4, 5, 2, 2, 2), f(5), stride=2, label="3d")
    add_case("pad", f(4, 6, 5), [1, 2], label="last-dim")
    add_case("pad", f(4, 6, 5), [0, 0, 2, 1], label="torch-order")
    add_case("pad", f(4, 6, 5), [1, 0, 0, 0, 0, 2], label="all-dims")
    add_case("pad", f(4, 6, 5, 3), [1, 1, 0, 2], mode="reflect", data_format="NHWC", label="reflect-nhwc")
    add_case("pad", f(4, 6, 5), [2, 0], value=1.5, label="value")


def _cases_nn():
    add_case("embedding", ints(11, 5, 3), f(11, 6))
    add_case("embedding", ints(11, 5), f(11, 6), padding_idx=3, label="padding_idx")
    add_case("one_hot", ints(6, 5, 3), num_classes=6)
    lab = ints(7, 5)
    add_case("cross_entropy", f(5, 7), lab, reduction="none", label="none")
    add_case("cross_entropy", f(5, 7), lab, reduction="sum", label="sum")
    add_case("cross_entropy", f(5, 7), lab, label="mean")
    add_case("cross_entropy", f(2, 5, 7), ints(7, 2, 5, 1), reduction="none", label="3d-label1")
    add_case("cross_entropy", f(5, 7), T(np.abs(f(5, 7).array) / 7, grad=False), soft_label=True, reduction="sum",
             label="soft")
    add_case("cross_entropy", f(5, 7, 3), ints(7, 5, 3), axis=1, reduction="none", label="axis1")
    q, k, v = f(2, 5, 6, 3), f(2, 7, 6, 3), f(2, 7, 6, 3)
    add_case("scaled_dot_product_attention", q, k, v, samples_2d=16)
    add_case("scaled_dot_product_attention", q, k, v, is_causal=True, label="causal", samples_2d=16)
    add_case("scaled_dot_product_attention", f(2, 5, 6, 3), f(2, 5, 3, 3), f(2, 5, 3, 3), label="gqa")
    add_case("scaled_dot_product_attention", f(2, 5, 4, 3), f(2, 5, 2, 3), f(2, 5, 2, 3), label="gqa-sharded",
             samples_2d=40)
    add_case("scaled_dot_product_attention", f(2, 5, 6, 3), f(2, 7, 6, 3), f(2, 7, 6, 3), f(2, 1, 5, 7),
             label="mask")
    add_case("scaled_dot_product_attention", q, k, v, dropout_p=0.5, label="dropout", grad=False)
    fq, fk, fv = (T(a.array.astype(np.float32)) for a in (f(2, 5, 6, 3), f(2, 7, 6, 3), f(2, 7, 6, 3)))
    add_case("flash_attention", fq, fk, fv, rtol=1e-4, atol=1e-5)
    add_case("flash_attention", fq, fk, fv, causal=True, label="causal", rtol=1e-4, atol=1e-5)
    add_case("rotary_embedding", f(2, 5, 3, 6), f(5, 1, 6), f(5, 1, 6))
    add_case("dropout", f(5, 6), p=0.0, label="p0")
    add_case("dropout", f(5, 6), p=0.3, training=False, mode="downscale_in_infer", label="eval-downscale")
    add_case("dropout", f(5, 6), p=0.3, label="random", grad=False)


def _cases_shape():
    add_case("reshape", f(6, 5, 4), [6, 20])
    add_case("reshape", f(6, 20), [6, 5, 4], label="split")
    add_case("reshape", f(24, 5), [6, -1, 5], label="split-first")
    add_case("reshape", f(5, 4, 6), [20, 6], label="flatten-uneven")
    add_case("reshape", f(2, 3, 5), [6, 1, 5], label="singleton")
    add_case("reshape", f(6, 5, 4), [0, 4, 5], label="copy-dim-regroup")
    add_case("view", f(6, 5, 4), [6, 20])
    add_case("flatten", f(6, 5, 4), start_axis=1)
    add_case("flatten", f(6, 5, 4), label="all")
    add_case("transpose", f(5, 6, 7), [2, 0, 1])
    add_case("t", f(5, 6))
    add_case("unsqueeze", f(5, 6), [0, 2])
    add_case("squeeze", f(5, 1, 6), axis=1)
    add_case("expand", f(5, 1, 6), [3, 5, 7, 6])
    add_case("broadcast_to", f(1, 6), [5, 6])
    add_case("split", f(5, 6, 7), [2, -1, 3], axis=2)
    add_case("split", f(5, 6), 2, axis=1, label="equal")
    add_case("chunk", f(6, 5), 3)
    add_case("concat", [f(5, 2), f(5, 6)], axis=1)
    add_case("concat", [f(5, 0, 3), f(5, 6, 3)], axis=1, label="empty-piece")
    add_case("stack", [f(5, 6), f(5, 6)], axis=1)
    add_case("getitem", f(5, 6, 7), (slice(None), 2, slice(1, 5)))
    add_case("getitem", f(5, 6, 7), (Ellipsis, None, slice(0, 7, 2)), label="ellipsis-none-step")
    add_case("getitem", f(5, 6, 7), (slice(None), [0, 4, 1]), label="list")
    add_case("getitem", f(5, 6, 7), (slice(None), ints(6, 6, 5)), label="tensor-index")
    add_case("getitem", f(5, 6), 3, label="int")
    add_case("setitem", f(5, 6), (slice(None), slice(0, 2)), 0.5, label="scalar")
    add_case("setitem", f(5, 6), (slice(1, 3),), f(2, 6), label="tensor-value")
    add_case("setitem", f(5, 6, 4), (slice(None), 2), f(5, 4), label="int-middle")
    add_case("setitem", f(5, 6, 4), (Ellipsis, slice(0, 2)), f(6, 1), label="broadcast-value")
    add_case("setitem", f(5, 6), (T(np.array([0, 3])),), f(2, 6), label="tensor-index", grad=False)
    add_case("getitem", f(5, 6, 2), -1, label="int-last-row")
    add_case("tril", f(5, 7))
    add_case("triu", f(2, 5, 7), diagonal=1)


def _cases_routing():
    add_case("topk", f(5, 6), 2)
    add_case("topk", f(5, 6), 3, axis=0, largest=False, label="axis0-smallest")
    add_case("argsort", f(5, 6), axis=0)
    add_case("sort", f(5, 6), descending=True)
    add_case("cumsum", f(5, 6), axis=1)
    add_case("cumsum", f(3, 4), label="flat")
    add_case("take_along_axis", f(5, 6), ints(6, 5, 2), axis=1)
    add_case("put_along_axis", f(5, 6), T(np.array([[0], [3], [5], [1], [2]])), f(5, 1), axis=1,
             label="assign")
    add_case("put_along_axis", f(5, 6), T(np.array([[0, 2], [3, 3], [5, 0], [1, 1], [2, 4]])), f(5, 2), axis=1,
             reduce="add", label="add")
    add_case("index_add", f(6, 4), T(np.array([4, 0, 4])), 0, f(3, 4))
    add_case("index_select", f(6, 4), T(np.array([5, 0, 2])), axis=0)
    add_case("gather", f(6, 4), T(np.array([3, 0, 2])), axis=1, label="axis1")
    add_case("gather", f(6, 4), T(np.array(3)), axis=0, label="0d-index")
    add_case("scatter", f(6, 4), T(np.array([3, 0, 5])), f(3, 4))
    add_case("scatter_nd_add", f(5, 6, 4), T(np.array([[1, 2], [4, 0], [1, 2]])), f(3, 4), label="rows")
    add_case("scatter_nd_add", f(5, 6), T(np.array([[[3], [0]], [[3], [4]]])), f(2, 2, 6), label="batched")
    add_case("index_fill", f(5, 6, 4), T(np.array([4, 0, 4])), 1, 2.5)
    add_case("cross", f(5, 3, 4), f(5, 3, 4), axis=1)
    add_case("cross", f(3, 6), f(3, 6), label="default-axis")
    add_case("renorm", f(5, 6, 4), 2.0, 1, 1.5)
    add_case("trapezoid", f(5, 6), axis=1)
    add_case("trapezoid", f(5, 6), f(5, 6), axis=0, label="sample-points")
    add_case("cdist", f(5, 4), f(6, 4))
    add_case("cdist", f(2, 5, 4), f(2, 3, 4), p=1.0, label="batched-p1")
    add_case("gather", f(5, 6), 1, ints(6, 5, 2), label="torch-form")
    add_case("scatter", f(5, 6), 1, T(np.array([[0, 2], [3, 4], [5, 0], [1, 3], [2, 4]])), f(5, 2),
             label="torch-form")
    add_case("index_put", f(5, 6), (T(np.array([0, 4])), T(np.array([1, 5]))), f(2), accumulate=True)
    add_case("permute", f(5, 6, 7), [2, 0, 1])
    add_case("nonzero", T(np.array([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0]])), grad=False)
    add_case("nonzero", T(np.array([[0.0, 1.5], [2.0, 0.0]])), as_tuple=True, grad=False, label="tuple")
    add_case("masked_select", f(4, 3), T(_rng("m", 0).random((4, 3)) > 0.5))
    add_case("bincount", T(np.array([0, 3, 3, 1, 6])), grad=False)
    add_case("bincount", T(np.array([0, 3, 3, 1])), f(4), minlength=6, grad=False, label="weights")
    add_case("where", T(np.array([[True, False, True], [False, False, True]])), grad=False, label="nonzero")
    add_case("unique", T(np.array([[3, 1, 3], [0, 1, 7]])), return_counts=True, return_inverse=True, grad=False)
    add_case("getitem", f(5, 6), (T(np.array([0, 4])), T(np.array([1, 5]))), label="two-tensor-indices")


def _cases_more():
    for op in ("reciprocal", "log2", "log10", "softplus", "log_sigmoid", "sinh", "cosh", "atan"):
        add_case(op, f(5, 6, lo=0.5))
    for op in ("expm1", "relu6", "hardswish", "mish", "elu", "selu", "softsign", "tanhshrink", "hardsigmoid", "tan",
               "asinh"):
        add_case(op, f(5, 6))
    add_case("asin", T(_rng("u", 1).uniform(-0.9, 0.9, (5, 6))))
    add_case("acos", T(_rng("u", 2).uniform(-0.9, 0.9, (5, 6))))
    add_case("atanh", T(_rng("u", 3).uniform(-0.9, 0.9, (5, 6))))
    add_case("acosh", f(5, 6, lo=1.5))
    for op in ("ceil", "round", "trunc"):
        add_case(op, f(5, 6), grad=False)
    add_case("nan_to_num", T(np.array([[1.0, np.nan, -2.0], [np.inf, 0.5, -np.inf]])), posinf=9.0, neginf=-9.0)
    for op in ("isnan", "isinf", "isfinite"):
        add_case(op, T(np.array([[1.0, np.nan, -2.0], [np.inf, 0.5, -np.inf]])), grad=False)
    add_case("amax", f(5, 6), axis=1)
    add_case("amin", f(5, 6), axis=0, keepdim=True)
    add_case("prod", f(4, 3, lo=0.5), axis=1)
    add_case("any", T(_rng("b", 1).random((5, 3)) > 0.7), axis=0)
    add_case("all", T(_rng("b", 2).random((5, 3)) > 0.2), axis=1, keepdim=True)
    add_case("logsumexp", f(5, 6), axis=-1)
    add_case("norm", f(5, 6), p=2, axis=1)
    add_case("var", f(5, 6), axis=0)
    add_case("std", f(5, 6), axis=1, keepdim=True)
    add_case("mm", f(5, 6), f(6, 3))
    add_case("mul", f(5, 6), f(5, 6))
    add_case("outer", f(5), f(4))
    add_case("swiglu", f(5, 8), label="halves")
    add_case("swiglu", f(5, 4), f(5, 4), label="two")
    add_case("flip", f(5, 6, 2), [0, 2])
    add_case("roll", f(5, 6), 2, axis=1)
    add_case("roll", f(5, 3), 4, label="flat")
    add_case("tile", f(5, 3), [2, 1])
    add_case("tile", f(5, 3), [2, 1, 1], label="new-dim")
    add_case("unbind", f(3, 4, 2), axis=1)
    add_case("diagonal", f(2, 5, 4), offset=1, axis1=1, axis2=2)
    add_case("unfold_windows", f(3, 7, 2), 1, 3, 2)
    add_case("fill_diagonal_", f(5, 3), 2.0, -1, True)
    add_case("fill_diagonal_tensor", f(3, 5, 4), f(5, 3), 0, 0, 2)
    add_case("diagonal_scatter", f(3, 5, 4), f(3, 3), 1, 1, 2)
    add_case("select_scatter", f(3, 5, 4), f(3, 4), 1, 2)
    add_case("slice_scatter", f(3, 5, 4), f(3, 2, 4), [1], [1], [5], [2])
    add_case("diag_embed", f(3, 4), 1)
    add_case("diag", f(5), 1, label="vector")
    add_case("diag", f(5, 4), -1, label="matrix")
    add_case("diagflat", f(2, 3))
    add_case("as_strided", f(3, 5, 4), [4, 3], [5, 2], 8)
    add_case("isin", f(5, 4), f(3))
    add_case("histogram", f(5, 4), 6, -1.0, 1.0, grad=False, label="range")
    add_case("histogram", f(5, 4), 6, -1.0, 1.0, f(5, 4), label="range-weight")
    add_case("histogram", f(5, 4), 6, grad=False, label="data-range")
    add_case("histogram_bin_edges", f(5, 4), 6, grad=False)
    add_case("unique_consecutive", ints(6, 4), True, True, grad=False)
    add_case("reduce_as", f(2, 5, 4), f(5, 1))
    spd = _spd(3, 4)
    chol = np.linalg.cholesky(spd)
    for op in ("inv", "det", "slogdet", "cholesky", "eigvalsh"):
        add_case(op, T(spd))
    add_case("matrix_exp", T(spd * 0.02))      # paddle's own backward fails on a large norm (an in-place squaring)
    add_case("matrix_power", T(spd), 2)
    add_case("eigh", T(spd))
    for op in ("eig", "eigvals"):
        add_case(op, f(3, 4, 4), grad=False)
    add_case("qr", f(3, 5, 4))
    add_case("svd", f(3, 5, 4), grad=False)
    add_case("svdvals", f(3, 5, 4))
    add_case("pinv", f(3, 5, 4))
    add_case("solve", T(spd), f(3, 4, 2))
    add_case("triangular_solve", T(chol), f(3, 4, 2), upper=False)
    add_case("cholesky_solve", f(3, 4, 2), T(chol))
    add_case("matrix_rank", f(3, 5, 4), grad=False)
    add_case("cond", T(spd))
    add_case("cholesky_inverse", T(chol[0]))
    lu_data, piv = (t.numpy() for t in _paddle().linalg.lu(_paddle().to_tensor(spd)))
    add_case("lu", T(spd), grad=False)
    add_case("lu_unpack", T(lu_data), T(piv), grad=False)
    add_case("lu_solve", f(3, 4, 2), T(lu_data), T(piv))
    add_case("householder_product", f(3, 5, 4), T(np.full((3, 4), 0.5)), grad=False)   # paddle's backward fails
    add_case("ormqr", T(spd), T(np.full((3, 4), 0.5)), f(3, 4, 2), grad=False)         # (in-place in its body)
    add_case("cumulative_trapezoid", f(3, 5, 4), dx=0.5, axis=1)
    add_case("cumulative_trapezoid", f(3, 5), f(3, 5), label="sample-points")
    add_case("vander", f(5), 4, True)
    add_case("shard_index", ints(20, 5, 1), 20, 2, 1, grad=False)
    add_case("multiplex", [f(5, 3), f(5, 3), f(5, 3)], T(np.array([[2], [0], [1], [1], [0]], "int32")))
    add_case("repeat_interleave", f(5, 3), 2, axis=0)
    add_case("expand_as", f(5, 1), f(5, 4))
    add_case("equal_all", f(5, 3), f(5, 3), grad=False)
    add_case("allclose", f(5, 3), f(5, 3), grad=False)
    add_case("masked_fill", f(5, 3), T(_rng("b", 3).random((5, 3)) > 0.5), 0.25)


def _cases_creation():
    add_case("full_like", f(5, 6), 2.0)
    add_case("zeros_like", f(5, 6))
    add_case("ones_like", f(5, 6), dtype="float32")
    add_case("arange", 7, creation=True, grad=False)
    add_case("arange", 1, 6, 2, creation=True, grad=False, label="step")
    add_case("arange", 0.0, 2.5, 0.5, creation=True, grad=False, label="float")
    add_case("full", [5, 6], 1.5, creation=True, grad=False)
    add_case("zeros", [5, 6], creation=True, grad=False)
    add_case("ones", [7], creation=True, grad=False)
    for op in ("rand", "randn", "uniform"):
        add_case(op, [5, 6], creation=True, grad=False)
    add_case("randint", 0, 9, [5, 6], creation=True, grad=False)


def _cases_optimizer():
    p32 = lambda *s, lo=None: T(f(*s, lo=lo).array.astype(np.float32))  # noqa: E731
    lr = T(np.array([0.1], np.float32), shard=False, grad=False)
    add_case("sgd", T(f(5, 6).array, partial=False, grad=False), T(np.array([0.1]), shard=False, grad=False),
             T(f(5, 6).array, grad=False))
    noP = dict(partial=False, grad=False)
    add_case("adamw", T(p32(5, 6).array, **noP), T(p32(5, 6).array, grad=False), lr,
             T(p32(5, 6).array, **noP), T(p32(5, 6, lo=0.1).array, **noP), None,
             T(np.array([0.9], np.float32), shard=False, grad=False),
             T(np.array([0.999], np.float32), shard=False, grad=False), None, None,
             0.9, 0.999, 1e-8, 1.0, 0.01, True, False, 1000, False, False, False, rtol=1e-5, atol=1e-6,
             samples_2d=16)


def _cases_elementwise_more():
    for op in ("sinc", "lgamma", "digamma", "deg2rad", "rad2deg", "negative", "positive", "swish", "hardtanh",
               "celu", "softshrink", "hardshrink", "stanh", "i0"):
        add_case(op, f(5, 6, lo=0.3) if op in ("lgamma", "digamma") else f(5, 6))
    add_case("erfinv", T(_rng("u", 4).uniform(-0.9, 0.9, (5, 6))))
    add_case("logit", T(_rng("u", 5).uniform(0.1, 0.9, (5, 6))), eps=1e-6)
    add_case("thresholded_relu", f(5, 6), threshold=0.2)
    for op in ("frac", "sgn"):
        add_case(op, f(5, 6), grad=op == "frac")
    add_case("signbit", f(5, 6), grad=False)
    for op in ("fmax", "fmin", "atan2", "hypot", "logaddexp"):
        add_case(op, f(5, 6), f(6))
    add_case("copysign", f(5, 6), f(5, 6), grad=False)
    add_case("heaviside", f(5, 6), f(6), grad=False)
    for op in ("gt", "logical_xor"):
        add_case(op, f(5, 6), f(6), grad=False)
    add_case("true_divide", f(5, 6), f(6, lo=0.5))
    add_case("isclose", f(5, 6), f(5, 6), grad=False)
    add_case("lerp", f(5, 6), f(5, 6), 0.3)
    add_case("lerp", f(5, 6), f(5, 6), f(6), label="tensor-weight")
    add_case("add_n", [f(5, 6), f(5, 6), f(5, 6)])


def _cases_math_more():
    nan = np.array([[1.0, np.nan, -2.0, 0.5], [np.nan, 0.5, 3.0, 1.0], [2.0, 1.0, np.nan, -1.0]])
    add_case("nansum", T(nan), axis=1)
    add_case("nansum", T(nan), label="all")
    add_case("nanmean", T(nan), axis=0)
    add_case("count_nonzero", ints(3, 5, 6), axis=1)
    add_case("median", f(5, 6), axis=1)
    add_case("median", f(5, 6), axis=0, mode="min", keepdim=True, label="min", grad=False)
    add_case("nanmedian", T(nan), axis=1, grad=False)
    add_case("cumprod", f(4, 5, lo=0.5), dim=1)
    add_case("logcumsumexp", f(4, 5), axis=0)
    add_case("cummax", f(4, 5), axis=1, grad=False)
    add_case("cummin", f(4, 5), axis=0, grad=False)
    add_case("diff", f(5, 6), axis=1)
    add_case("diff", f(5, 6), n=2, axis=0, prepend=f(2, 6), append=f(1, 6), label="prepend-append")
    add_case("trace", f(3, 5, 5), offset=1, axis1=1, axis2=2)
    add_case("dot", f(6), f(6))
    add_case("dot", f(4, 6), f(4, 6), label="batched")
    add_case("mv", f(5, 6), f(6))
    add_case("inner", f(3, 6), f(4, 6))
    add_case("tensordot", f(3, 4, 5), f(4, 5, 2), axes=2)
    add_case("tensordot", f(3, 4, 5), f(5, 3), axes=[[0, 2], [1, 0]], label="pairs")
    add_case("kron", f(2, 3), f(3, 2))
    add_case("gather_nd", f(4, 5), ints(4, 3, 1), grad=False)
    add_case("index_sample", f(4, 5), ints(5, 4, 2), grad=False)
    add_case("take", f(4, 5), ints(20, 3), grad=False)


def _cases_pooling():
    add_case("max_pool1d", f(2, 3, 8), 2)
    add_case("avg_pool1d", f(2, 3, 8), 3, stride=2, padding=1)
    add_case("max_pool2d", f(2, 3, 6, 6), 2, stride=2)
    add_case("max_pool2d", f(2, 3, 7, 7), 3, stride=2, padding=1, ceil_mode=True, label="ceil")
    add_case("max_pool2d", f(2, 3, 6, 6), 2, return_mask=True, label="mask", grad=False)
    add_case("max_pool2d", f(2, 6, 6, 3), 2, data_format="NHWC", label="nhwc")
    add_case("avg_pool2d", f(2, 3, 6, 6), 2, padding="SAME", stride=2)
    add_case("avg_pool2d", f(2, 3, 6, 6), [3, 2], padding=[1, 0], exclusive=False, label="not-exclusive")
    add_case("avg_pool3d", f(2, 2, 4, 4, 4), 2)
    add_case("max_pool3d", f(2, 2, 4, 4, 4), 2)
    add_case("adaptive_avg_pool1d", f(2, 3, 8), 3)
    add_case("unfold", f(3, 2, 5, 5), 2, strides=1, paddings=1)
    add_case("unfold", f(3, 2, 6, 5), [3, 2], strides=[2, 1], paddings=[1, 0, 0, 1], dilations=1, label="rect")
    add_case("fold", f(3, 8, 36), [5, 5], 2, paddings=1)
    add_case("grid_sample", f(3, 2, 4, 5), T(f(3, 3, 3, 2).array * 0.9, partial=False))
    add_case("grid_sample", f(3, 2, 4, 5), T(f(3, 2, 3, 2).array * 0.9, partial=False), mode="nearest",
             padding_mode="border", align_corners=False, label="nearest")
    for nsp, shape in ((1, (2, 3, 4)), (2, (2, 3, 3, 3)), (3, (2, 2, 2, 2, 2))):
        add_case(f"max_unpool{nsp}d", f(*shape), T(_unpool_mask(shape), partial=False, grad=False), 2)
    add_case("adaptive_avg_pool2d", f(2, 3, 6, 6), [2, 3])
    add_case("adaptive_avg_pool2d", f(2, 6, 6, 3), 2, data_format="NHWC", label="nhwc")
    add_case("adaptive_max_pool1d", f(2, 3, 8), 4)
    add_case("adaptive_max_pool2d", f(2, 3, 6, 6), [3, None], label="none-size")
    add_case("adaptive_avg_pool3d", f(2, 2, 4, 4, 4), 2)
    add_case("adaptive_max_pool3d", f(2, 2, 4, 4, 4), 2)


def _cases_complex():
    def c(*shape):
        return T(f(*shape, 2).array[..., 0] + 1j * f(*shape, 2).array[..., 1])

    for op in ("as_complex", "view_as_complex"):
        add_case(op, f(5, 6, 2))
    for op in ("as_real", "view_as_real", "real", "imag", "conj", "angle"):
        add_case(op, c(5, 6), grad=False)
    add_case("complex", f(5, 6), f(6))
    add_case("polar", f(5, 6, lo=0.3), f(6))
    for k in ("fft", "ifft", "rfft", "ihfft", "irfft", "hfft"):
        real_in = k in ("rfft", "ihfft")
        add_case(k, f(4, 6) if real_in else c(4, 6), grad=False)
        for d in ("2", "n"):
            add_case(k + d, f(3, 4, 6) if real_in else c(3, 4, 6), grad=False)


def _cases_special():
    _cases_complex()
    for op in ("i0e", "i1", "i1e"):
        add_case(op, f(5, 6))
    add_case("gammaln", f(5, 6, lo=0.3))
    for op in ("gammainc", "gammaincc"):
        add_case(op, f(5, 6, lo=0.5), f(5, 6, lo=0.5))
    add_case("polygamma", f(5, 6, lo=0.3), 1)
    inf = T(np.array([[1.0, -np.inf, 2.0], [np.inf, 0.5, -1.0]]))
    for op in ("isneginf", "isposinf", "isreal"):
        add_case(op, inf, grad=False)
    add_case("gcd", ints(20, 5, 6, low=1), ints(20, 6, low=1))
    add_case("lcm", ints(9, 5, 6, low=1), ints(9, 5, 6, low=1))
    add_case("nextafter", f(5, 6), f(6), grad=False)
    add_case("bitwise_xor", ints(16, 5, 6), ints(16, 6))
    add_case("bitwise_left_shift", ints(16, 5, 6), ints(4, 5, 6))
    add_case("bitwise_right_shift", ints(64, 5, 6), ints(4, 6))
    add_case("bitwise_invert", ints(16, 5, 6))


def _cases_interpolate():
    add_case("interpolate", f(2, 3, 4, 4), size=[6, 5], mode="bilinear")
    add_case("interpolate", f(2, 3, 4, 4), scale_factor=2, mode="nearest", label="scale")
    add_case("interpolate", f(2, 4, 4, 3), scale_factor=[1.5, 2.0], mode="bicubic", align_corners=True,
             data_format="NHWC", label="nhwc-bicubic")
    add_case("interpolate", f(2, 3, 5), size=[8], mode="linear", data_format="NCW", label="1d")
    add_case("interpolate", f(2, 2, 3, 3, 3), scale_factor=2, mode="trilinear", label="3d")
    add_case("upsample", f(2, 3, 4, 4), scale_factor=2, mode="nearest")
    add_case("quantile", f(5, 6), 0.3, axis=1)
    add_case("quantile", f(5, 6), [0.25, 0.5], axis=0, keepdim=True, label="list-q")
    add_case("quantile", f(4, 3), 0.7, label="all")
    add_case("nanquantile", T(np.array([[1.0, np.nan, -2.0, 0.5], [np.nan, 0.5, 3.0, 1.0]])), 0.5, axis=1,
             grad=False)
    add_case("kthvalue", f(5, 6), 2, axis=1)
    add_case("mode", ints(3, 5, 6), axis=0)
    add_case("lp_pool1d", f(2, 3, 8, lo=0.1), 2.0, 2)
    add_case("lp_pool2d", f(2, 3, 6, 6, lo=0.1), 3.0, 2, stride=2)
    add_case("lp_pool2d", f(2, 6, 6, 3, lo=0.1), 2.0, 3, stride=1, padding=1, data_format="NHWC", label="nhwc-pad")


def _spd(b, n):
    """A batch of b symmetric positive definite n x n matrices (well conditioned: a aT + n I)."""
    a = np.random.default_rng(11).standard_normal((b, n, n))
    return a @ a.transpose(0, 2, 1) + n * np.eye(n)


def _unpool_mask(shape):
    """Valid max-pool indices for kernel 2 / stride 2: one position inside each window, flat per (n, c) plane."""
    rng = np.random.default_rng(7)
    spatial = shape[2:]
    out = [2 * s for s in spatial]
    grids = np.meshgrid(*[np.arange(s) for s in spatial], indexing="ij")
    flat = np.zeros(shape, dtype=np.int32)
    for n in range(shape[0]):
        for c in range(shape[1]):
            pos = [2 * g + rng.integers(0, 2, size=g.shape) for g in grids]
            flat[n, c] = np.ravel_multi_index(pos, out)
    return flat
