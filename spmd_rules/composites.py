"""Composite ops: paddle functions that run on distributed tensors as our own decomposition into public,
routed paddle ops (each of which has an spmd rule), never as paddle's own function (which may reach an
unrouted C op and compute on a local shard).

``COMPOSITES`` maps a dotted path to its decomposition. A decomposition has paddle's signature (so every
call form binds the same), mirrors paddle's semantics for every argument, and raises a typed error for an
argument value it does not support. The runtime installs a wrapper that calls the decomposition when an
argument is distributed and paddle's function otherwise (``autoparallel.dispatch_install``). Paddle is
imported when a decomposition runs, so ``spmd_rules`` itself stays free of paddle at import.

This module: losses and nn functions; ``composites_shape`` adds shape helpers, products and norms.
"""
from __future__ import annotations

import math


def _p():
    import paddle

    return paddle


def _F():
    import paddle.nn.functional as F

    return F


def gshape(t) -> list:
    """The global shape of a tensor (a DistParameter's ``.shape`` is its local shard's)."""
    g = getattr(t, "global_shape", None)
    return list(g) if g is not None else list(t.shape)


def _check_reduction(op, reduction, allowed=("mean", "sum", "none")):
    if reduction not in allowed:
        raise ValueError(f"{op}: reduction must be one of {list(allowed)}, got {reduction!r}")


def _reduce(out, reduction):
    paddle = _p()
    if reduction == "sum":
        return paddle.sum(out)
    if reduction == "mean":
        return paddle.mean(out)
    return out


def _const(t):
    """``t`` without gradient: paddle's kernel gives none to this input (labels, ``pos_weight``, ...)."""
    return None if t is None else t.detach()


def _same_shape(op, a, b, names=("input", "label")):
    if gshape(a) != gshape(b):
        raise ValueError(f"{op}: {names[0]} and {names[1]} must have the same shape, got {gshape(a)} and "
                         f"{gshape(b)}")


# ---- regression losses -----------------------------------------------------------------------------------------------
def square_error_cost(input, label):
    return _p().square(input - label)


def mse_loss(input, label, reduction="mean", name=None):
    _check_reduction("mse_loss", reduction)
    return _reduce(_p().square(input - label), reduction)


def l1_loss(input, label, reduction="mean", name=None):
    _check_reduction("l1_loss", reduction)
    return _reduce(_p().abs(input - label), reduction)


def smooth_l1_loss(input, label, reduction="mean", delta=1.0, is_huber=True, name=None):
    _check_reduction("smooth_l1_loss", reduction)
    paddle = _p()
    r = label - input
    a = paddle.abs(r)
    out = paddle.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))
    if not is_huber:
        out = out / delta
    return _reduce(out, reduction)


# ---- classification losses -------------------------------------------------------------------------------------------
def binary_cross_entropy(input, label, weight=None, reduction="mean", name=None):
    _check_reduction("binary_cross_entropy", reduction)
    paddle = _p()
    label = _const(label)
    lp = paddle.clip(paddle.log(input), min=-100.0)
    lq = paddle.clip(paddle.log(1.0 - input), min=-100.0)
    out = -(label * lp + (1.0 - label) * lq)
    if weight is not None:
        out = out * weight
    return _reduce(out, reduction)


def _sigmoid_ce(logit, label, pos_weight=None):
    """paddle's sigmoid_cross_entropy_with_logits (normalize=False, ignore_index=-100)."""
    paddle = _p()
    label, pos_weight = _const(label), _const(pos_weight)
    soft = paddle.log1p(paddle.exp(-paddle.abs(logit))) + paddle.clip(-logit, min=0.0)
    if pos_weight is None:
        out = (1.0 - label) * logit + soft
    else:
        out = (1.0 - label) * logit + (label * (pos_weight - 1.0) + 1.0) * soft
    return paddle.where(label == -100.0, paddle.zeros_like(out), out)


def binary_cross_entropy_with_logits(logit, label, weight=None, reduction="mean", pos_weight=None, name=None):
    _check_reduction("binary_cross_entropy_with_logits", reduction)
    out = _sigmoid_ce(logit, label, pos_weight)
    if weight is not None:
        out = out * weight
    return _reduce(out, reduction)


def sigmoid_focal_loss(logit, label, normalizer=None, alpha=0.25, gamma=2.0, reduction="sum", name=None):
    _check_reduction("sigmoid_focal_loss", reduction)
    if normalizer is not None and len(gshape(normalizer)) > 1:
        raise ValueError(f"sigmoid_focal_loss: normalizer must have zero or one dim, got {gshape(normalizer)}")
    paddle = _p()
    loss = _sigmoid_ce(logit, label)
    pred = paddle.nn.functional.sigmoid(logit)
    p_t = pred * label + (1.0 - pred) * (1.0 - label)
    alpha_t = alpha * label + (1.0 - alpha) * (1.0 - label)
    loss = alpha_t * loss * paddle.pow(1.0 - p_t, float(gamma))
    if normalizer is not None:
        loss = loss / normalizer
    return _reduce(loss, reduction)


def log_loss(input, label, epsilon=0.0001, name=None):
    if len(gshape(input)) != 2 or gshape(input)[1] != 1:
        raise ValueError(f"log_loss: input must have shape [N, 1], got {gshape(input)}")
    paddle = _p()
    label = _const(label)
    return -label * paddle.log(input + epsilon) - (1.0 - label) * paddle.log(1.0 - input + epsilon)


def soft_margin_loss(input, label, reduction="mean", name=None):
    _check_reduction("soft_margin_loss", reduction)
    _same_shape("soft_margin_loss", input, label)
    paddle = _p()
    label = paddle.cast(label, input.dtype)
    return _reduce(paddle.log(1 + paddle.exp(-label * input)), reduction)


def margin_ranking_loss(input, other, label, margin=0.0, reduction="mean", name=None):
    _check_reduction("margin_ranking_loss", reduction)
    out = (other - input) * label
    if margin != 0.0:
        out = out + margin
    return _reduce(_F().relu(out), reduction)


def hinge_embedding_loss(input, label, margin=1.0, reduction="mean", name=None):
    _check_reduction("hinge_embedding_loss", reduction)
    paddle = _p()
    zero = paddle.zeros_like(input)
    loss = paddle.where(label == 1.0, input, zero) + paddle.where(label == -1.0, _F().relu(margin - input), zero)
    return _reduce(loss, reduction)


def multi_label_soft_margin_loss(input, label, weight=None, reduction="mean", name=None):
    _check_reduction("multi_label_soft_margin_loss", reduction)
    _same_shape("multi_label_soft_margin_loss", input, label)
    F = _F()
    loss = -(label * F.log_sigmoid(input) + (1 - label) * F.log_sigmoid(-input))
    if weight is not None:
        loss = loss * weight
    return _reduce(loss.mean(axis=-1), reduction)


def poisson_nll_loss(input, label, log_input=True, full=False, epsilon=1e-08, reduction="mean", name=None):
    if epsilon <= 0:
        raise ValueError(f"poisson_nll_loss: epsilon must be positive, got {epsilon}")
    _check_reduction("poisson_nll_loss", reduction)
    _same_shape("poisson_nll_loss", input, label)
    paddle = _p()
    if log_input:
        out = paddle.exp(input) - label * input
    else:
        out = input - label * paddle.log(input + epsilon)
    if full:
        st = label * paddle.log(label) - label + 0.5 * paddle.log(2 * math.pi * label)
        out = out + paddle.where(label > 1, st, paddle.zeros_like(st))
    return _reduce(out, reduction)


def kl_div(input, label, reduction="mean", log_target=False, name=None):
    _check_reduction("kl_div", reduction, ("mean", "sum", "none", "batchmean"))
    paddle = _p()
    label = _const(label)
    dt = {str(input.dtype), str(label.dtype)}
    if dt == {"paddle.float32", "paddle.float64"}:        # paddle promotes the float32 one
        input, label = paddle.cast(input, "float64"), paddle.cast(label, "float64")
    if log_target:
        out = paddle.exp(label) * (label - input)
    else:
        safe = paddle.where(label > 0, label, paddle.ones_like(label))
        out = paddle.where(label > 0, label * (paddle.log(safe) - input), paddle.zeros_like(input))
    if reduction == "batchmean":
        shape = gshape(input)
        return paddle.sum(out) / shape[0] if shape else out
    return _reduce(out, reduction)


def nll_loss(input, label, weight=None, ignore_index=-100, reduction="mean", name=None):
    _check_reduction("nll_loss", reduction)
    paddle = _p()
    ish, lsh = gshape(input), gshape(label)
    if len(ish) < 2:
        raise ValueError(f"nll_loss: input must have 2 or more dims [N, C, ...], got {ish}")
    if lsh != [ish[0]] + ish[2:]:
        raise ValueError(f"nll_loss: label must have shape {[ish[0]] + ish[2:]} for input {ish}, got {lsh}")
    keep = label != ignore_index
    safe = paddle.where(keep, label, paddle.zeros_like(label))
    picked = paddle.take_along_axis(input, safe.unsqueeze(1), axis=1).squeeze(1)
    w = keep.astype(input.dtype)
    if weight is not None:
        w = w * paddle.gather(_const(weight), safe.reshape([-1])).reshape(lsh)
    out = -picked * w
    if reduction == "mean":        # paddle divides only by a nonzero total weight: no counted label gives 0
        total = paddle.sum(w)
        return paddle.sum(out) / paddle.where(total == 0, paddle.ones_like(total), total)
    return _reduce(out, reduction)


def softmax_with_cross_entropy(logits, label, soft_label=False, ignore_index=-100, numeric_stable_mode=True,
                               return_softmax=False, axis=-1):
    F = _F()
    nd = len(gshape(logits))
    a = axis % nd if -nd <= axis < nd else None
    if a is None:
        raise ValueError(f"softmax_with_cross_entropy: axis {axis} is out of range for {nd}-D logits")
    if not soft_label and len(gshape(label)) != nd:
        raise ValueError(f"softmax_with_cross_entropy: label must have the logits' rank with 1 at axis {a}, "
                         f"got {gshape(label)} for logits {gshape(logits)}")
    if soft_label:        # -sum(label * log_softmax): any layout of the class axis
        loss = -_p().sum(_const(label) * F.log_softmax(logits, axis=axis), axis=axis, keepdim=True)
    else:
        loss = F.cross_entropy(logits, label, ignore_index=ignore_index, reduction="none", axis=axis)
    if return_softmax:
        return loss, F.softmax(logits, axis=axis)
    return loss


# ---- nn functions ----------------------------------------------------------------------------------------------------
def glu(x, axis=-1, name=None):
    nd = len(gshape(x))
    if not -nd <= axis < nd:
        raise ValueError(f"glu: axis must be in [{-nd}, {nd}), got {axis}")
    a, b = _p().chunk(x, 2, axis=axis)
    return a * _F().sigmoid(b)


def cosine_similarity(x1, x2, axis=1, eps=1e-8):
    paddle = _p()
    n1, n2 = gshape(x1)[axis], gshape(x2)[axis]
    w12 = paddle.sum(x1 * x2, axis=axis)
    if n1 == 0 or n2 == 0:
        return w12
    w1 = paddle.sum(x1 * x1, axis=axis)
    w2 = paddle.sum(x2 * x2, axis=axis)
    n = max(n1, n2)
    if n / n1 != 1:
        w1 = w1 * (n / n1)
    if n / n2 != 1:
        w2 = w2 * (n / n2)
    return w12 / paddle.sqrt(paddle.clip(w1 * w2, min=eps * eps))


def _p_norm(x, p, axis, keepdim):
    """||x||_p over ``axis`` from sums and maxima (a sharded axis reduces to a Partial, then finishes)."""
    paddle = _p()
    p = float(p)
    a = paddle.abs(x)
    if p == math.inf:
        return paddle.amax(a, axis=axis, keepdim=keepdim)
    if p == -math.inf:
        return paddle.amin(a, axis=axis, keepdim=keepdim)
    if p == 0:
        return paddle.sum((x != 0).astype(x.dtype), axis=axis, keepdim=keepdim)
    if p == 2:
        return paddle.sqrt(paddle.sum(x * x, axis=axis, keepdim=keepdim))
    if p == 1:
        return paddle.sum(a, axis=axis, keepdim=keepdim)
    return paddle.pow(paddle.sum(paddle.pow(a, p), axis=axis, keepdim=keepdim), 1.0 / p)


def normalize(x, p=2, axis=1, epsilon=1e-12, out=None, name=None):
    if out is not None:
        raise NotImplementedError("normalize: out= is not supported on distributed tensors; use the result")
    if not isinstance(p, (int, float)) or isinstance(p, bool):
        raise TypeError(f"normalize: p must be a number, got {type(p).__name__} {p!r}")
    if not isinstance(axis, int):
        raise TypeError(f"normalize: axis must be an int, got {type(axis).__name__} {axis!r}")
    nd = len(gshape(x))
    if nd == 1 and axis not in (0, -1):
        raise ValueError(f"normalize: axis must be 0 or -1 when x is 1-D, got {axis}")
    paddle = _p()
    return x / paddle.clip(_p_norm(x, p, axis, True), min=epsilon)


def pairwise_distance(x, y, p=2.0, epsilon=1e-6, keepdim=False, name=None):
    sub = x - y
    if epsilon != 0.0:
        sub = sub + epsilon
    return _p_norm(sub, p, -1, keepdim)


def label_smooth(label, prior_dist=None, epsilon=0.1, name=None):
    if epsilon > 1.0 or epsilon < 0.0:
        raise ValueError(f"label_smooth: epsilon must be in [0, 1], got {epsilon}")
    if prior_dist is not None:
        return (1.0 - epsilon) * label + epsilon * _const(prior_dist)
    return (1.0 - epsilon) * label + epsilon / gshape(label)[-1]


def _check_format(op, data_format, allowed):
    if data_format not in allowed:
        raise ValueError(f"{op}: data_format must be one of {list(allowed)}, got {data_format!r}")


def group_norm(x, num_groups, epsilon=1e-05, weight=None, bias=None, data_format="NCHW", name=None):
    op = "group_norm"
    _check_format(op, data_format, ("NCL", "NCHW", "NCDHW", "NLC", "NHWC", "NDHWC"))
    paddle = _p()
    shape = gshape(x)
    last = data_format[-1] == "C" and data_format != "NC"
    c = shape[-1] if last else shape[1]
    if c % num_groups:
        raise ValueError(f"{op}: {c} channels do not split into num_groups={num_groups}")
    h = paddle.transpose(x, [0, len(shape) - 1] + list(range(1, len(shape) - 1))) if last else x
    g = h.reshape([shape[0], num_groups, -1])
    mean = paddle.mean(g, axis=2, keepdim=True)
    var = paddle.mean(paddle.square(g - mean), axis=2, keepdim=True)
    y = ((g - mean) / paddle.sqrt(var + epsilon)).reshape(gshape(h))
    bshape = [1, c] + [1] * (len(shape) - 2)
    if weight is not None:
        y = y * weight.reshape(bshape)
    if bias is not None:
        y = y + bias.reshape(bshape)
    if last:
        y = paddle.transpose(y, [0] + list(range(2, len(shape))) + [1])
    return y


def instance_norm(x, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                  momentum=0.9, eps=1e-05, data_format="NCHW", name=None):
    op = "instance_norm"
    _check_format(op, data_format, ("NC", "NCL", "NCHW", "NCDHW"))
    if not use_input_stats:
        raise NotImplementedError(f"{op}: use_input_stats=False (running statistics) is not supported on "
                                  f"distributed tensors")
    paddle = _p()
    shape = gshape(x)
    axes = list(range(2, len(shape)))
    mean = paddle.mean(x, axis=axes, keepdim=True)
    var = paddle.mean(paddle.square(x - mean), axis=axes, keepdim=True)
    y = (x - mean) / paddle.sqrt(var + eps)
    bshape = [1, shape[1]] + [1] * (len(shape) - 2)
    if weight is not None:
        y = y * weight.reshape(bshape)
    if bias is not None:
        y = y + bias.reshape(bshape)
    return y


_F_NAMES = ("square_error_cost", "mse_loss", "l1_loss", "smooth_l1_loss", "binary_cross_entropy",
            "binary_cross_entropy_with_logits", "sigmoid_focal_loss", "log_loss", "soft_margin_loss",
            "margin_ranking_loss", "hinge_embedding_loss", "multi_label_soft_margin_loss", "poisson_nll_loss",
            "kl_div", "nll_loss", "softmax_with_cross_entropy", "glu", "cosine_similarity", "normalize",
            "pairwise_distance", "label_smooth", "group_norm", "instance_norm")
COMPOSITES: dict = {f"paddle.nn.functional.{n}": globals()[n] for n in _F_NAMES}


def mse_loss_layer_forward(self, input, label):
    """``paddle.nn.MSELoss.forward`` calls the C op ``square`` directly; on distributed tensors it is
    ``mse_loss`` with the layer's reduction."""
    return mse_loss(input, label, self.reduction)


COMPOSITES["paddle.nn.layer.loss.MSELoss.forward"] = mse_loss_layer_forward


def conv_layer_forward(self, *args, **kwargs):
    """``paddle.nn.Conv2D/Conv3D.forward`` call paddle's private ``_conv_nd`` (a C op) directly; on distributed
    tensors they are ``F.conv2d`` / ``F.conv3d`` with the layer's attributes (its padding mode as ``F.pad``)."""
    import paddle.nn.functional as F

    if len(args) + len(kwargs) != 1:
        raise TypeError(f"{type(self).__name__}.forward takes one input (x), got {len(args)} positional and "
                        f"{sorted(kwargs)} keyword arguments")
    x = args[0] if args else kwargs.get("x", kwargs.get("input"))
    padding = self._padding
    if self._padding_mode != "zeros":
        x = F.pad(x, self._reversed_padding_repeated_twice, mode=self._padding_mode, data_format=self._data_format)
        padding = 0
    conv = {2: F.conv2d, 3: F.conv3d}[len(self._kernel_size)]
    return conv(x, self.weight, self.bias, stride=self._stride, padding=padding, dilation=self._dilation,
                groups=self._groups, data_format=self._data_format)


def legacy_batch_norm_forward(self, input):
    """``paddle.nn.BatchNorm`` (the layer DenseNet and older model zoos build, with a fused ``act``) calls the C
    op directly; on distributed tensors it is ``F.batch_norm`` (synchronised statistics) then the activation."""
    import paddle.nn.functional as F

    if self._trainable_statistics:
        raise NotImplementedError("paddle.nn.BatchNorm(trainable_statistics=True) on distributed tensors: "
                                  "F.batch_norm has no such mode; use trainable_statistics=False")
    y = F.batch_norm(input, self._mean, self._variance, self.weight, self.bias, training=self.training,
                     momentum=self._momentum, epsilon=self._epsilon, data_format=self._data_layout,
                     use_global_stats=True if self._use_global_stats else None)   # None: running stats in eval
    if self._act is None:
        return y
    act = getattr(F, self._act, None)
    if act is None:
        raise NotImplementedError(f"paddle.nn.BatchNorm(act={self._act!r}) on distributed tensors: no "
                                  f"paddle.nn.functional.{self._act}")
    return act(y)


COMPOSITES["paddle.nn.layer.norm.BatchNorm.forward"] = legacy_batch_norm_forward


def sync_batch_norm_layer_forward(self, x):
    """``paddle.nn.SyncBatchNorm`` on distributed tensors: ``F.batch_norm``, whose statistics are already
    reduced over every mesh dim the batch is split on (paddle's own CPU build has no sync kernel)."""
    import paddle.nn.functional as F

    self._check_data_format()
    return F.batch_norm(x, self._mean, self._variance, self.weight, self.bias, training=self.training,
                        momentum=self._momentum, epsilon=self._epsilon, data_format=self._data_format)


COMPOSITES["paddle.nn.layer.norm.SyncBatchNorm.forward"] = sync_batch_norm_layer_forward
COMPOSITES["paddle.nn.layer.conv.Conv2D.forward"] = conv_layer_forward
COMPOSITES["paddle.nn.layer.conv.Conv3D.forward"] = conv_layer_forward


# ---- channel dropout (F.dropout with paddle's axes: one draw for the global shape, see spmd_rules/random.py) ---------
def _check_p(op, p):
    if p < 0 or p > 1:
        raise ValueError(f"{op}: dropout probability must be in [0, 1], got {p}")


def dropout1d(input, p=0.5, training=True, inplace=False):
    _check_p("dropout1d", p)
    nd = len(gshape(input))
    if nd not in (2, 3):
        raise ValueError(f"dropout1d: expects a 2-D or 3-D input, got {nd}-D")
    if inplace:
        raise NotImplementedError("dropout1d: inplace=True is not supported (paddle ignores it too)")
    x = input.unsqueeze(0) if nd == 2 else input
    out = _F().dropout(x, p=p, axis=1, training=training)
    return out.squeeze(0) if nd == 2 else out


def _dropout_nd(op, nd, formats):
    def fn(x, p=0.5, training=True, data_format=formats[0], name=None):
        if len(gshape(x)) != nd:
            raise ValueError(f"{op}: x must be {nd}-D, got {gshape(x)}")
        _check_format(op, data_format, formats)
        axis = [0, 1] if data_format == formats[0] else [0, nd - 1]
        return _F().dropout(x, p=p, axis=axis, training=training, mode="upscale_in_train")

    fn.__name__ = op
    return fn


dropout2d = _dropout_nd("dropout2d", 4, ("NCHW", "NHWC"))
dropout3d = _dropout_nd("dropout3d", 5, ("NCDHW", "NDHWC"))
COMPOSITES.update({f"paddle.nn.functional.{n}": globals()[n] for n in ("dropout1d", "dropout2d", "dropout3d")})
