"""Sample calls of the composite ops (spmd_rules.composites*), shared by the coverage tests: (dotted path,
args, kwargs) with deterministic float32 / int64 tensors."""
import numpy as np
import paddle
import paddle.nn.functional as F

_RNG = np.random.default_rng(1234)


def t(*shape, lo=None, hi=None):
    a = _RNG.standard_normal(shape) if lo is None else _RNG.uniform(lo, hi, shape)
    return paddle.to_tensor(a.astype("float32"))


def ints(values):
    return paddle.to_tensor(np.array(values, dtype="int64"))


def build():
    x, y = t(4, 6), t(4, 6)
    p01 = t(4, 6, lo=0.05, hi=0.95)
    lab = paddle.to_tensor((_RNG.random((4, 6)) > 0.5).astype("float32"))
    pm = lab * 2 - 1
    fn = "paddle.nn.functional."
    cases = [
        (fn + "mse_loss", (x, y), {}), (fn + "mse_loss", (x, y), {"reduction": "sum"}),
        (fn + "l1_loss", (x, y), {"reduction": "none"}), (fn + "square_error_cost", (x, y), {}),
        (fn + "smooth_l1_loss", (x, y), {"delta": 0.5}),
        (fn + "smooth_l1_loss", (x, y), {"delta": 0.5, "is_huber": False, "reduction": "none"}),
        (fn + "binary_cross_entropy", (p01, lab), {"weight": t(6, lo=0.5, hi=1.0)}),
        (fn + "binary_cross_entropy_with_logits", (x, lab), {}),
        (fn + "binary_cross_entropy_with_logits", (x, lab),
         {"pos_weight": t(6, lo=0.5, hi=2.0), "weight": t(6, lo=0.5, hi=1.0), "reduction": "sum"}),
        (fn + "sigmoid_focal_loss", (x, lab), {"normalizer": t(1, lo=1, hi=2), "reduction": "mean"}),
        (fn + "log_loss", (t(4, 1, lo=0.05, hi=0.95), lab[:, :1]), {}),
        (fn + "soft_margin_loss", (x, pm), {}), (fn + "margin_ranking_loss", (x, y, pm), {"margin": 0.3}),
        (fn + "hinge_embedding_loss", (x, pm), {}),
        (fn + "multi_label_soft_margin_loss", (x, lab), {"weight": t(6)}),
        (fn + "poisson_nll_loss", (x, p01 * 3), {}),
        (fn + "poisson_nll_loss", (p01, p01 * 3), {"log_input": False, "full": True}),
        (fn + "kl_div", (x, p01 - 0.3), {}),
        (fn + "kl_div", (x, x * 0.1), {"log_target": True, "reduction": "batchmean"}),
        (fn + "nll_loss", (F.log_softmax(x, axis=1), ints([0, 5, -100, 2])), {"weight": t(6, lo=0.5, hi=1.0)}),
        (fn + "nll_loss", (F.log_softmax(t(2, 3, 4), axis=1), ints([[0, 2, 1, 1], [2, 0, 0, 1]])),
         {"reduction": "none"}),
        (fn + "softmax_with_cross_entropy", (x, ints([[0], [5], [3], [2]])), {"return_softmax": True}),
        (fn + "softmax_with_cross_entropy", (x, F.softmax(y)), {"soft_label": True}),
        (fn + "glu", (x,), {}), (fn + "glu", (x,), {"axis": 0}),
        (fn + "cosine_similarity", (x, y), {}), (fn + "cosine_similarity", (x, t(1, 6)), {"axis": 1}),
        (fn + "normalize", (x,), {}), (fn + "normalize", (x,), {"p": 1, "axis": 0}),
        (fn + "normalize", (x,), {"p": float("inf"), "axis": -1}),
        (fn + "pairwise_distance", (x, y), {}), (fn + "pairwise_distance", (x, y), {"p": 3.0, "keepdim": True}),
        (fn + "label_smooth", (lab,), {}), (fn + "label_smooth", (lab,), {"prior_dist": t(1, 6), "epsilon": 0.2}),
        (fn + "group_norm", (t(2, 6, 3, 3), 3), {"weight": t(6), "bias": t(6)}),
        (fn + "group_norm", (t(2, 3, 3, 6), 2), {"data_format": "NHWC"}),
        (fn + "instance_norm", (t(2, 3, 4, 4),), {"weight": t(3), "bias": t(3)}),
        (fn + "dropout2d", (t(2, 4, 3, 3), 0.0), {}),
        ("paddle.hstack", ([x, y],), {}), ("paddle.hstack", ([t(3), t(2)],), {}), ("paddle.vstack", ([x, y],), {}),
        ("paddle.vstack", ([t(3), t(3)],), {}), ("paddle.dstack", ([x, y],), {}),
        ("paddle.column_stack", ([t(4), x],), {}), ("paddle.row_stack", ([x, t(6)],), {}),
        ("paddle.unstack", (x,), {"axis": 1}), ("paddle.unflatten", (x, 1, [2, -1]), {}),
        ("paddle.moveaxis", (t(2, 3, 4), [0, 1], [2, 0]), {}), ("paddle.ravel", (x,), {}),
        ("paddle.view_as", (x, t(6, 4)), {}), ("paddle.matrix_transpose", (t(2, 3, 4),), {}),
        ("paddle.narrow", (x, 1, -4, 3), {}), ("paddle.tensor_split", (t(7, 3), 3), {}),
        ("paddle.tensor_split", (t(3, 7), [2, -1, 9]), {"axis": 1}), ("paddle.hsplit", (x, 3), {}),
        ("paddle.vsplit", (x, [1, 3]), {}), ("paddle.dsplit", (t(2, 2, 6), 2), {}),
        ("paddle.strided_slice", (x, [0, 1], [0, 1], [4, 6], [2, 2]), {}),
        ("paddle.slice", (x, [1], [-3], [100]), {}), ("paddle.broadcast_tensors", ([t(4, 1), t(6)],), {}),
        ("paddle.addmm", (t(4, 5), x, t(6, 5)), {"beta": 0.5, "alpha": 2.0}),
        ("paddle.baddbmm", (t(2, 3, 5), t(2, 3, 4), t(2, 4, 5)), {"alpha": 0.5}),
        ("paddle.atleast_3d", (t(3), t(2, 2)), {}), ("paddle.atleast_2d", (t(3),), {}),
        ("paddle.linalg.vector_norm", (x,), {}),
        ("paddle.linalg.vector_norm", (x,), {"p": 1, "axis": 1, "keepdim": True}),
        ("paddle.linalg.vector_norm", (x,), {"p": float("inf"), "axis": [0, 1]}),
        ("paddle.linalg.vector_norm", (x,), {"p": 3, "axis": 0}),
        ("paddle.linalg.matrix_norm", (t(2, 4, 5),), {}), ("paddle.linalg.matrix_norm", (t(2, 4, 5),), {"p": 1}),
        ("paddle.linalg.matrix_norm", (t(2, 4, 5),), {"p": float("-inf"), "keepdim": True}),
        ("paddle.linalg.multi_dot", ([t(3, 4), t(4, 5), t(5)],), {}),
        (fn + "pixel_shuffle", (t(2, 8, 3, 2), 2), {}),
        (fn + "pixel_shuffle", (t(2, 3, 2, 8), 2), {"data_format": "NHWC"}),
        (fn + "pixel_unshuffle", (t(2, 2, 4, 6), 2), {}),
        (fn + "pixel_unshuffle", (t(2, 4, 6, 2), 2), {"data_format": "NHWC"}),
        (fn + "channel_shuffle", (t(2, 6, 2, 2), 3), {}),
        (fn + "channel_shuffle", (t(2, 2, 2, 6), 2), {"data_format": "NHWC"}),
        (fn + "prelu", (t(2, 3, 4), t(3)), {}), (fn + "prelu", (t(2, 4, 3), t(1)), {"data_format": "NLC"}),
        (fn + "prelu", (t(2, 4, 4, 3), t(3)), {"data_format": "NHWC"}),
        (fn + "maxout", (t(2, 6, 3, 3), 3), {}), (fn + "maxout", (t(2, 3, 3, 4), 2), {"axis": -1}),
        (fn + "cosine_embedding_loss", (x, y, ints([1, -1, 1, -1])), {"margin": 0.2}),
        (fn + "gaussian_nll_loss", (x, y, t(4, 6, lo=0.1, hi=2.0)), {}),
        (fn + "gaussian_nll_loss", (x, y, t(4, 1, lo=0.1, hi=2.0)), {"full": True, "reduction": "sum"}),
        (fn + "triplet_margin_loss", (x, y, t(4, 6)), {"margin": 0.5}),
        (fn + "triplet_margin_loss", (x, y, t(4, 6)), {"p": 1, "swap": True, "reduction": "none"}),
        ("paddle.atleast_1d", (paddle.to_tensor(1.5), t(3)), {}), ("paddle.linalg.matrix_transpose", (t(2, 3, 4),), {}),
        (fn + "dropout1d", (t(3, 4, 5), 0.0), {}), (fn + "dropout1d", (t(4, 5), 0.5), {"training": False}),
        (fn + "dropout3d", (t(2, 3, 2, 2, 2), 0.3), {"training": False, "data_format": "NDHWC"}),
        (fn + "multi_margin_loss", (x, ints([0, 5, 3, 2])), {}),
        (fn + "multi_margin_loss", (x, ints([0, 5, 3, 2])), {"p": 2, "margin": 0.5, "weight": t(6, lo=0.5, hi=1.0),
                                                             "reduction": "none"}),
        (fn + "zeropad2d", (t(2, 3, 4, 4), [1, 0, 2, 1]), {}),
        (fn + "bilinear", (t(4, 3), t(4, 5), t(2, 3, 5)), {"bias": t(1, 2)}),
        (fn + "sequence_mask", (ints([3, 1, 4, 2]),), {}), (fn + "sequence_mask", (ints([[3, 1], [4, 2]]),),
                                                           {"maxlen": 6, "dtype": "float32"}),
        (fn + "local_response_norm", (t(2, 6, 5), 3), {}), (fn + "local_response_norm", (t(2, 3, 3, 6), 4),
                                                               {"data_format": "NHWC", "alpha": 0.1}),
        (fn + "local_response_norm", (t(2, 5, 3, 3), 2), {"beta": 0.5}),
        ("paddle.vecdot", (x, y), {}), ("paddle.linalg.vecdot", (x, y), {"axis": 0}), ("paddle.dist", (x, y), {}),
        ("paddle.dist", (x, y), {"p": float("inf")}), ("paddle.dist", (x, y), {"p": 1.5}),
        ("paddle.rot90", (t(2, 3, 4),), {}), ("paddle.rot90", (t(2, 3, 4),), {"k": 3, "axes": [1, 2]}),
        ("paddle.rot90", (t(2, 3, 4),), {"k": 2}), ("paddle.msort", (x,), {}),
        ("paddle.ldexp", (x, ints([[1, 2, 0, -1, 3, 1]])), {}), ("paddle.numel", (x,), {}),
    ]
    return cases


def tensors_of(args, kwargs) -> list:
    """The tensor arguments of a call, in order (entering lists)."""
    out = []
    for v in list(args) + list(kwargs.values()):
        for u in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(u, paddle.Tensor):
                out.append(u)
    return out


def substitute(args, kwargs, mapping):
    """``(args, kwargs)`` with every tensor ``u`` replaced by ``mapping[id(u)]``."""
    def sub(v):
        if isinstance(v, list):
            return [mapping.get(id(u), u) for u in v]
        return mapping.get(id(v), v)

    return tuple(sub(a) for a in args), {k: sub(v) for k, v in kwargs.items()}
