"""Which paddle callables each rule covers, as dotted paths (pure data; nothing here imports paddle).

``OP_TABLE[rule_name]`` lists the paddle callables the runtime routes to that rule; the FIRST entry is the
canonical functional form whose signature the rule mirrors (the rule checker runs it as ground truth).
A rule's parameters are the callable's parameters with a DistSpec for every tensor, so a call maps
one-to-one, except where ``ARG_MAP`` says otherwise for a dotted path:

* ``"swap"``: a reflected operator ``Tensor.__rxxx__(self, other)`` calls the rule as ``rule(other, self)``;
* ``{"rename": {paddle_kw: rule_kw}}``: keyword arguments renamed (positional arguments map unchanged);
* ``"scalar_1d"``: a python number operand becomes a one-element 1-d tensor, as paddle's operator does
  (so a 0-d tensor ``// 2`` has shape [1]); ``"swap_scalar_1d"``: both (``3 // t``);
* ``{"fixed": {rule_kw: value}}``: extra keyword arguments the rule gets (e.g. ``paddle.t`` is a
  transpose of the last two dims).

Tensor methods take ``self`` as the first positional argument (the rule's first tensor parameter);
operators (``__add__`` ...) and paddle's internal update ops have no python signature and are always
called positionally.
Rules with an empty list (e.g. ``rotary_embedding``) are names for custom ops reached through
``register_spmd_rule`` users or composite layers, not through a paddle callable.
"""
from __future__ import annotations

_T = "paddle.Tensor."


def _fn(name, *, module="paddle", method=True, extra=()):
    paths = [f"{module}.{name}"]
    if method:
        paths.append(_T + name)
    return tuple(paths) + tuple(extra)


OP_TABLE: dict = {
    # matmul family
    "matmul": ("paddle.matmul", _T + "matmul", _T + "__matmul__", _T + "__rmatmul__"),
    "linear": ("paddle.nn.functional.linear",),
    "bmm": ("paddle.bmm", _T + "bmm"),
    "einsum": ("paddle.einsum",),
    # unary
    "relu": ("paddle.nn.functional.relu",),
    "gelu": ("paddle.nn.functional.gelu",),
    "silu": ("paddle.nn.functional.silu",),
    "tanh": ("paddle.tanh", _T + "tanh", "paddle.nn.functional.tanh"),
    "sigmoid": ("paddle.nn.functional.sigmoid", _T + "sigmoid", "paddle.sigmoid"),
    "exp": _fn("exp"),
    "log": _fn("log"),
    "log1p": _fn("log1p"),
    "sqrt": _fn("sqrt"),
    "rsqrt": _fn("rsqrt"),
    "neg": _fn("neg", extra=(_T + "__neg__",)),
    "abs": _fn("abs", extra=(_T + "__abs__",)),
    "erf": _fn("erf"),
    "sin": _fn("sin"),
    "cos": _fn("cos"),
    "square": _fn("square"),
    "floor": _fn("floor"),
    "sign": _fn("sign"),
    "clone": _fn("clone"),
    "leaky_relu": ("paddle.nn.functional.leaky_relu",),
    "clip": _fn("clip"),
    "pow": _fn("pow", extra=(_T + "__pow__", _T + "__rpow__")),
    "scale": _fn("scale"),
    "cast": ("paddle.cast", _T + "cast", _T + "astype"),
    "logical_not": _fn("logical_not"),
    # binary
    "add": _fn("add", extra=(_T + "__add__", _T + "__radd__")),
    "subtract": _fn("subtract", extra=(_T + "__sub__", _T + "__rsub__")),
    "multiply": _fn("multiply", extra=(_T + "__mul__", _T + "__rmul__")),
    "divide": _fn("divide", extra=(_T + "__truediv__", _T + "__rtruediv__")),
    "floor_divide": _fn("floor_divide", extra=(_T + "__floordiv__", _T + "__rfloordiv__")),
    "remainder": _fn("remainder", extra=(_T + "__mod__", _T + "__rmod__")),
    "maximum": _fn("maximum"),
    "minimum": _fn("minimum"),
    "where": _fn("where"),
    "equal": _fn("equal", extra=(_T + "__eq__",)),
    "not_equal": _fn("not_equal", extra=(_T + "__ne__",)),
    "less_than": _fn("less_than", extra=(_T + "__lt__",)),
    "less_equal": _fn("less_equal", extra=(_T + "__le__",)),
    "greater_than": _fn("greater_than", extra=(_T + "__gt__",)),
    "greater_equal": _fn("greater_equal", extra=(_T + "__ge__",)),
    "logical_and": _fn("logical_and"),
    "logical_or": _fn("logical_or"),
    # Tensor's &, |, ~ are paddle's bitwise ops (on bools the same as logical_*, on integers bit by bit)
    "bitwise_and": _fn("bitwise_and", extra=(_T + "__and__",)),
    "bitwise_or": _fn("bitwise_or", extra=(_T + "__or__",)),
    "bitwise_xor": _fn("bitwise_xor", extra=(_T + "__xor__",)),
    "bitwise_not": _fn("bitwise_not", extra=(_T + "__invert__",)),
    # reductions
    "sum": _fn("sum"),
    "mean": _fn("mean"),
    "max": _fn("max"),
    "min": _fn("min"),
    "argmax": _fn("argmax"),
    "argmin": _fn("argmin"),
    # softmax / norms
    "softmax": ("paddle.nn.functional.softmax", _T + "softmax"),
    "log_softmax": ("paddle.nn.functional.log_softmax",),
    "layer_norm": ("paddle.nn.functional.layer_norm", "paddle.nn.layer.norm.layer_norm"),
    "rms_norm": ("paddle.nn.functional.rms_norm",),
    "batch_norm": ("paddle.nn.functional.batch_norm", "paddle.nn.layer.norm.batch_norm"),
    # embedding / loss / attention
    "embedding": ("paddle.nn.functional.embedding",),
    "one_hot": ("paddle.nn.functional.one_hot",),
    "cross_entropy": ("paddle.nn.functional.cross_entropy",),
    "scaled_dot_product_attention": ("paddle.nn.functional.scaled_dot_product_attention",),
    "flash_attention": ("paddle.nn.functional.flash_attention.flash_attention",),
    "rotary_embedding": (),
    # shape
    "reshape": _fn("reshape"),
    "view": (_T + "view",),
    "flatten": _fn("flatten"),
    "transpose": _fn("transpose"),
    "t": _fn("t"),
    "unsqueeze": _fn("unsqueeze"),
    "squeeze": _fn("squeeze"),
    "expand": _fn("expand"),
    "broadcast_to": _fn("broadcast_to"),
    "split": _fn("split"),
    "chunk": _fn("chunk"),
    "concat": ("paddle.concat",),
    "stack": ("paddle.stack",),
    "getitem": (_T + "__getitem__",),
    "setitem": (),              # x[index] = value: installed as an in-place form (dispatch), local op "setitem"
    "tril": _fn("tril"),
    "triu": _fn("triu"),
    # mixture-of-experts routing (spmd_rules/routing.py)
    "topk": _fn("topk"),
    "argsort": _fn("argsort"),
    "sort": _fn("sort"),
    "cumsum": _fn("cumsum"),
    "take_along_axis": _fn("take_along_axis"),
    "put_along_axis": _fn("put_along_axis"),
    "index_add": _fn("index_add"),
    "index_select": _fn("index_select"),
    "gather": _fn("gather"),
    "scatter": _fn("scatter"),
    "scatter_nd_add": _fn("scatter_nd_add"),
    "index_fill": _fn("index_fill"),
    "cross": _fn("cross"),
    "renorm": _fn("renorm"),
    "trapezoid": _fn("trapezoid"),
    "cdist": _fn("cdist"),
    "index_put": _fn("index_put"),
    "permute": _fn("permute"),
    "nonzero": _fn("nonzero"),
    "masked_select": _fn("masked_select"),
    "masked_scatter": _fn("masked_scatter"),
    "argwhere": ("paddle.argwhere",),
    "searchsorted": ("paddle.searchsorted",),
    "bucketize": _fn("bucketize"),
    "bincount": _fn("bincount"),
    "unique": _fn("unique"),
    # more everyday ops (spmd_rules/more_ops.py)
    **{n: _fn(n) for n in ("reciprocal", "log2", "log10", "expm1", "tan", "atan", "asin", "acos", "sinh", "cosh",
                           "asinh", "acosh", "atanh", "ceil", "round", "trunc", "nan_to_num", "isnan", "isinf",
                           "isfinite", "amax", "amin", "prod", "any", "all", "logsumexp", "norm", "var", "std",
                           "mm", "mul", "outer", "flip", "roll", "tile", "unbind", "diagonal", "repeat_interleave",
                           "expand_as", "equal_all", "allclose", "masked_fill")},
    **{n: (f"paddle.nn.functional.{n}",) for n in ("softplus", "relu6", "hardswish", "mish", "elu", "selu",
                                                     "softsign", "tanhshrink", "hardsigmoid", "log_sigmoid")},
    "swiglu": ("paddle.nn.functional.swiglu", "paddle.incubate.nn.functional.swiglu"),
    # creation
    "full_like": ("paddle.full_like",),
    "zeros_like": ("paddle.zeros_like",),
    "ones_like": ("paddle.ones_like",),
    "arange": ("paddle.arange",),
    "full": ("paddle.full",),
    "zeros": ("paddle.zeros",),
    "ones": ("paddle.ones",),
    # randomness
    "dropout": ("paddle.nn.functional.dropout",),
    "rand": ("paddle.rand",),
    "randn": ("paddle.randn",),
    "uniform": ("paddle.uniform",),
    "randint": ("paddle.randint",),
    # conv
    "conv1d": ("paddle.nn.functional.conv1d",),
    "pad": ("paddle.nn.functional.pad",),
    "conv2d": ("paddle.nn.functional.conv2d",),
    "conv3d": ("paddle.nn.functional.conv3d",),
    **{f"conv{n}d_transpose": (f"paddle.nn.functional.conv{n}d_transpose",) for n in (1, 2, 3)},
    **{f"max_unpool{n}d": (f"paddle.nn.functional.max_unpool{n}d",) for n in (1, 2, 3)},
    **{n: (f"paddle.nn.functional.{n}",) for n in ("unfold", "fold", "grid_sample")},
    # optimizer updates (called by the sharded optimizer with paddle's internal argument order)
    "sgd": ("paddle._C_ops.sgd_",),
    "adamw": ("paddle._C_ops.adamw_",),
    # more elementwise math (spmd_rules/elementwise_more.py)
    **{n: _fn(n) for n in ("sinc", "i0", "lgamma", "digamma", "erfinv", "deg2rad", "rad2deg", "frac", "sgn",
                           "signbit", "negative", "logit", "stanh", "fmax", "fmin", "copysign", "heaviside",
                           "atan2", "hypot", "logaddexp", "gammainc", "gammaincc", "logical_xor", "true_divide",
                           "isclose", "lerp", "add_n")},
    "positive": ("paddle.positive", _T + "__pos__"),
    "gt": _fn("gt", extra=("paddle.greater", _T + "greater")),
    **{n: (f"paddle.nn.functional.{n}",) for n in ("swish", "hardtanh", "celu", "softshrink", "hardshrink",
                                                     "thresholded_relu")},
    # reductions, scans, products (spmd_rules/math_more.py)
    **{n: _fn(n) for n in ("nansum", "count_nonzero", "nanmean", "median", "nanmedian", "cumprod",
                           "logcumsumexp", "cummax", "cummin", "diff", "trace", "dot", "mv", "inner",
                           "tensordot", "kron", "gather_nd", "index_sample", "take")},
    # pooling (spmd_rules/pooling.py)
    **{f"{k}_pool{n}d": (f"paddle.nn.functional.{k}_pool{n}d",)
       for k in ("max", "avg", "adaptive_avg", "adaptive_max") for n in (1, 2, 3)},
    # special, integer and bitwise elementwise ops (spmd_rules/elementwise_more.py)
    **{n: _fn(n) for n in ("i0e", "i1", "i1e", "gammaln", "isneginf", "isposinf", "isreal", "gcd", "lcm",
                           "nextafter", "polygamma", "bitwise_left_shift",
                           "bitwise_right_shift", "bitwise_invert")},
    # interpolation and order statistics (spmd_rules/nn_more.py)
    "interpolate": ("paddle.nn.functional.interpolate",),
    "upsample": ("paddle.nn.functional.upsample",),
    **{n: _fn(n) for n in ("quantile", "nanquantile", "kthvalue", "mode")},
    "lp_pool1d": ("paddle.nn.functional.lp_pool1d",),
    "lp_pool2d": ("paddle.nn.functional.lp_pool2d",),
    # GPU-only fused kernels (spmd_rules/fused.py): reached through spmd_rules/composites_fused.py, which refuses
    # them on CPU (paddle has no CPU kernel) and routes them to these rules elsewhere
    **{n: () for n in ("fused_linear", "fused_matmul_bias", "fused_bias_act", "fused_rotary_position_embedding",
                       "fused_feedforward", "fused_multi_head_attention", "flash_attn_unpadded",
                       "flashmask_attention", "softmax_mask_fuse_upper_triangle")},
    "softmax_mask_fuse": ("paddle.incubate.softmax_mask_fuse",),
    # diagonals, sliding windows, scatters into a slice (spmd_rules/diag_ops.py); F.unfold (patches of an image)
    # holds the rule name "unfold", so Tensor.unfold / paddle.unfold (windows along one axis) is "unfold_windows"
    "unfold_windows": ("paddle.unfold", _T + "unfold"),
    "fill_diagonal_": (_T + "fill_diagonal_",),
    "fill_diagonal_tensor": (_T + "fill_diagonal_tensor",),
    "diag_embed": _fn("diag_embed", extra=("paddle.nn.functional.diag_embed",)),
    **{n: _fn(n) for n in ("diag", "diagflat", "diagonal_scatter", "select_scatter", "slice_scatter",
                           "as_strided")},
    # Fourier transforms (spmd_rules/fft_ops.py)
    **{k + d: ("paddle.fft." + k + d,) for k in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")
       for d in ("", "2", "n")},
    # complex numbers (spmd_rules/complex_ops.py)
    **{n: _fn(n) for n in ("as_complex", "as_real", "real", "imag", "conj", "angle")},
    **{n: _fn(n, method=False) for n in ("complex", "polar", "view_as_complex", "view_as_real")},
    # value tests and counts, reduce_as (spmd_rules/value_ops.py)
    **{n: _fn(n) for n in ("isin", "histogram", "histogram_bin_edges", "unique_consecutive", "reduce_as",
                           "shard_index", "multiplex")},
    # per-matrix linear algebra, whole matrices (spmd_rules/linalg_ops.py)
    "inv": ("paddle.linalg.inv", "paddle.inverse", _T + "inverse"),
    **{n: ("paddle.linalg." + n,) for n in ("det", "svd", "svdvals", "eigh", "matrix_exp", "triangular_solve",
                                            "matrix_rank", "lu_solve")},
    **{n: ("paddle.linalg." + n, _T + n) for n in ("eig", "eigvals")},
    **{n: ("paddle.linalg." + n, _T + n) for n in ("slogdet", "qr", "matrix_power", "pinv", "solve",
                                                   "cholesky_solve", "cond", "cholesky_inverse",
                                                   "householder_product", "ormqr", "lu", "lu_unpack")},
    **{n: ("paddle.linalg." + n, "paddle." + n, _T + n) for n in ("cholesky", "eigvalsh")},
    "cumulative_trapezoid": _fn("cumulative_trapezoid"),
    "vander": _fn("vander"),
}

# paths that are paddle's in-place form of an op with no out-of-place form: the rule computes the result (its
# local op on a copy) and the tensor takes it, as for ``x.add_`` next to ``add``
IN_PLACE_PATHS = frozenset({_T + "fill_diagonal_"})

ARG_MAP: dict = {
    _T + "__radd__": "swap",
    _T + "__rsub__": "swap",
    _T + "__rmul__": "swap",
    _T + "__rtruediv__": "swap",
    _T + "__rmatmul__": "swap",
    _T + "__rpow__": "swap",
    _T + "__rmod__": "swap",
    _T + "__rfloordiv__": "swap_scalar_1d",     # 3 // (0-d tensor) is a [1] tensor too
    _T + "__getitem__": {"rename": {"self": "x", "item": "index"}},
    _T + "__neg__": {"rename": {"var": "x"}},
    _T + "__abs__": {"rename": {"var": "x"}},
    _T + "clone": {"rename": {"self": "x"}},
    _T + "astype": {"rename": {"self": "x"}},
    _T + "softmax": {"rename": {"input": "x", "dim": "axis"}},      # torch-style method; dim=None means -1
    "paddle.t": {"rename": {"input": "x"}},
    _T + "t": {"rename": {"input": "x"}},
    "paddle.nn.functional.rms_norm": {"rename": {"input": "x"}},
    _T + "__floordiv__": "scalar_1d",      # paddle: 0-d tensor // python number is a [1] tensor (not 0-d)
}


def rule_for(dotted: str):
    """The rule name covering a paddle callable's dotted path, or None."""
    for name, paths in OP_TABLE.items():
        if dotted in paths:
            return name
    return None
