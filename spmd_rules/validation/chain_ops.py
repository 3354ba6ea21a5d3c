"""The ops a chain is built from: for each, a generator of its arguments from the current full shape and
the call itself, written once with paddle's public API so the same call runs on full tensors and on
DistTensors. ``gen(rng, shape) -> (params, extras)`` returns None when the op does not apply to ``shape``;
``extras`` are new input arrays, each ``(name, array)``, placed at random by the chain builder."""
from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F


def _f32(rng, shape):
    return rng.standard_normal(shape).astype("float32")


def _axis(rng, shape):
    return int(rng.integers(len(shape)))


# ---- views ---------------------------------------------------------------------------------------------
def gen_reshape(rng, shape):
    if not shape:
        return None
    kind = rng.integers(3)
    if kind == 0 or len(shape) == 1:
        new = [int(np.prod(shape))] if len(shape) > 1 else None
        if new is None:
            n = shape[0]
            fs = [f for f in range(2, n) if n % f == 0]
            if not fs:
                return None
            f = int(rng.choice(fs))
            new = [f, n // f]
    elif kind == 1:
        i = int(rng.integers(len(shape) - 1))
        new = list(shape[:i]) + [shape[i] * shape[i + 1]] + list(shape[i + 2:])
    else:
        i = _axis(rng, shape)
        fs = [f for f in range(2, shape[i]) if shape[i] % f == 0]
        if not fs or len(shape) >= 4:
            return None
        f = int(rng.choice(fs))
        new = list(shape[:i]) + [f, shape[i] // f] + list(shape[i + 1:])
    if rng.random() < 0.3:
        new[int(rng.integers(len(new)))] = -1
    return {"shape": new}, []


def do_reshape(t, ex, shape):
    return t.reshape(shape)


def gen_transpose(rng, shape):
    if len(shape) < 2:
        return None
    return {"perm": [int(i) for i in rng.permutation(len(shape))], "form": int(rng.integers(2))}, []


def do_transpose(t, ex, perm, form):
    if form == 1 and len(perm) == 2:
        return t.T
    return paddle.transpose(t, perm)


def gen_flatten(rng, shape):
    if len(shape) < 2:
        return None
    a = int(rng.integers(len(shape) - 1))
    return {"start": a, "stop": int(rng.integers(a + 1, len(shape)))}, []


def do_flatten(t, ex, start, stop):
    return paddle.flatten(t, start, stop)


def gen_expand(rng, shape):
    if len(shape) >= 4:
        return None
    k = int(rng.integers(len(shape) + 1))
    return {"axis": k, "size": int(rng.integers(2, 4))}, []


def do_expand(t, ex, axis, size):
    u = t.unsqueeze(axis)
    target = list(u.shape)
    target[axis] = size
    return u.expand(target)


def gen_slice(rng, shape):
    dims = [i for i, s in enumerate(shape) if s >= 2]
    if not dims:
        return None
    d = int(rng.choice(dims))
    a = int(rng.integers(shape[d] - 1))
    b = int(rng.integers(a + 1, shape[d] + 1))
    return {"dim": d, "start": a, "stop": b, "step": int(rng.choice([1, 1, 2]))}, []


def do_slice(t, ex, dim, start, stop, step):
    return t[(slice(None),) * dim + (slice(start, stop, step),)]


def gen_split(rng, shape):
    dims = [i for i, s in enumerate(shape) if s >= 2]
    if not dims:
        return None
    d = int(rng.choice(dims))
    divs = [n for n in range(2, shape[d] + 1) if shape[d] % n == 0]
    form = int(rng.integers(3))
    if form == 2:   # sections
        a = int(rng.integers(1, shape[d]))
        return {"dim": d, "n": [a, shape[d] - a], "pick": int(rng.integers(2)), "form": form}, []
    n = int(rng.choice(divs))
    return {"dim": d, "n": n, "pick": int(rng.integers(n)), "form": form}, []


def do_split(t, ex, dim, n, pick, form):
    parts = paddle.chunk(t, n, axis=dim) if form == 1 else paddle.split(t, n, axis=dim)
    return parts[pick]


# ---- elementwise and broadcasting --------------------------------------------------------------------
def gen_binary(rng, shape):
    keep = int(rng.integers(len(shape) + 1)) if shape else 0
    oshape = [1 if rng.random() < 0.3 else s for s in shape[len(shape) - keep:]]
    return {"op": str(rng.choice(["add", "subtract", "multiply", "maximum"])), "swap": bool(rng.random() < 0.3)}, \
        [("y", _f32(rng, oshape))]


def do_binary(t, ex, op, swap):
    a, b = (ex[0], t) if swap else (t, ex[0])
    if op == "add" and not swap:
        return a + b
    return getattr(paddle, op)(a, b)


def gen_unary(rng, shape):
    return {"op": str(rng.choice(["tanh", "sigmoid", "square", "softmax", "scale"]))}, []


def do_unary(t, ex, op):
    if op == "softmax":
        return F.softmax(t, axis=-1) if t.ndim else t
    if op == "scale":
        return paddle.scale(t, 0.5, bias=1.0)
    return getattr(paddle, op)(t)


def gen_reduce(rng, shape):
    op = str(rng.choice(["sum", "mean", "max", "min", "sum"]))
    axis = _axis(rng, shape) if shape and rng.random() < 0.85 else None
    if axis is not None and rng.random() < 0.3:
        axis = axis - len(shape)                    # a negative axis
    elif axis is not None and len(shape) >= 2 and rng.random() < 0.3:
        axis = sorted({axis, _axis(rng, shape)})    # several axes
    keep = bool(rng.random() < 0.5)
    return {"op": op, "axis": axis, "keepdim": keep, "then": int(rng.integers(3))}, []


def do_reduce(t, ex, op, axis, keepdim, then):
    r = getattr(t, op)(axis=axis, keepdim=keepdim)
    if then == 0 or (not keepdim and axis is not None):
        return r
    return t - r if then == 1 else t * r          # the reduced value used with the input it came from


def gen_where(rng, shape):
    return {"form": int(rng.integers(2))}, [("m", _f32(rng, shape)), ("y", _f32(rng, shape))]


def do_where(t, ex, form):
    mask = ex[0] > 0
    return paddle.where(mask, t, ex[1]) if form == 0 else paddle.where(mask, ex[1], t)


# ---- joins ------------------------------------------------------------------------------------------
def gen_concat(rng, shape):
    if not shape:
        return None
    d = _axis(rng, shape)
    stack = bool(rng.random() < 0.4) and len(shape) < 4
    oshape = list(shape)
    if not stack:
        oshape[d] = int(rng.integers(1, 5))
    return {"dim": d, "stack": stack}, [("y", _f32(rng, oshape))]


def do_concat(t, ex, dim, stack):
    return paddle.stack([t, ex[0]], axis=dim) if stack else paddle.concat([t, ex[0]], axis=dim)


# ---- in place ----------------------------------------------------------------------------------------
def gen_inplace(rng, shape):
    form = str(rng.choice(["add_", "scale_", "setitem", "setitem_t", "multiply_", "view_write"]))
    extras = []
    params = {"form": form}
    if form in ("add_", "multiply_"):
        extras = [("y", _f32(rng, shape))]
    if form.startswith("setitem"):
        if not shape:
            return None
        g = gen_slice(rng, shape)
        if g is None:
            return None
        params.update(g[0])
        if form == "setitem_t":
            sl = np.empty(shape)[(slice(None),) * params["dim"] + (slice(params["start"], params["stop"],
                                                                          params["step"]),)]
            extras = [("v", _f32(rng, sl.shape))]
    return params, extras


def do_inplace(t, ex, form, dim=0, start=0, stop=0, step=1):
    t = t * 1.0                           # in-place on a non-leaf: paddle refuses it on a leaf needing grad
    if form == "add_":
        t.add_(ex[0])
    elif form == "multiply_":
        t.multiply_(ex[0])
    elif form == "scale_":
        t.scale_(2.0)
    elif form == "view_write":            # through a view: paddle changes t too; a DistTensor refuses reading t
        (t.reshape([-1]) if t.ndim != 1 else t[0:1]).scale_(2.0)
    else:
        idx = (slice(None),) * dim + (slice(start, stop, step),)
        t[idx] = ex[0] if form == "setitem_t" else 0.5
    return t


# ---- contractions and indexing ----------------------------------------------------------------------
def gen_matmul(rng, shape):
    if not shape or len(shape) > 3:
        return None
    left = len(shape) >= 2 and rng.random() < 0.3
    k = int(rng.integers(1, 6))
    wshape = [k, shape[-2]] if left else [shape[-1], k]
    return {"left": bool(left), "form": int(rng.integers(2))}, [("w", _f32(rng, wshape))]


def do_matmul(t, ex, left, form):
    a, b = (ex[0], t) if left else (t, ex[0])
    return a @ b if form == 0 else paddle.matmul(a, b)


def gen_gather(rng, shape):
    if not shape:
        return None
    d = _axis(rng, shape)
    n = int(rng.integers(1, 7))
    idx = rng.integers(shape[d], size=n).astype("int64")
    return {"dim": d, "fn": str(rng.choice(["index_select", "gather"]))}, [("idx", idx)]


def do_gather(t, ex, dim, fn):
    return getattr(paddle, fn)(t, ex[0], axis=dim)


# ---- an explicit reshard mid-chain (identity on full tensors) -----------------------------------------
def gen_reshard(rng, shape):
    return {"to": [str(rng.choice(["R", "P"] + [f"S{d}" for d in range(len(shape))])) for _ in range(2)]}, []


def do_reshard(t, ex, to):
    if not hasattr(t, "locals"):
        return t
    import autoparallel as ap
    pl = [ap.Replicate() if p == "R" else ap.Partial("sum") if p == "P" else ap.Shard(int(p[1:]))
          for p in to[:t.mesh.ndim]]
    return ap.reshard(t, t.mesh, pl)


# ---- more shape and value forms --------------------------------------------------------------------
def gen_misc(rng, shape):
    forms = ["cumsum", "flip", "tile", "unsqueeze", "clip", "cast", "pow", "roll", "tensor_index"]
    if any(s == 1 for s in shape):
        forms.append("squeeze")
    if len(shape) >= 2:
        forms.append("swapaxes")
    form = str(rng.choice(forms))
    params = {"form": form, "axis": _axis(rng, shape) if shape else 0}
    if form == "squeeze":
        params["axis"] = int(rng.choice([i for i, s in enumerate(shape) if s == 1]))
    if form in ("tile", "cumsum", "flip", "roll", "tensor_index", "swapaxes") and not shape:
        return None
    if form == "tensor_index":
        return params, [("idx", rng.integers(shape[0], size=int(rng.integers(1, 5))).astype("int64"))]
    return params, []


def do_misc(t, ex, form, axis):
    if form == "cumsum":
        return paddle.cumsum(t, axis=axis)
    if form == "flip":
        return paddle.flip(t, axis=[axis])
    if form == "tile":
        reps = [1] * t.ndim
        reps[axis] = 2
        return paddle.tile(t, reps)
    if form == "unsqueeze":
        return paddle.unsqueeze(t, axis)
    if form == "squeeze":
        return t.squeeze(axis)
    if form == "clip":
        return paddle.clip(t, -0.5, 0.7)
    if form == "cast":
        return t.astype("float64").astype("float32")
    if form == "pow":
        return t ** 2 + 1.0
    if form == "roll":
        return paddle.roll(t, 1, axis=axis)
    if form == "swapaxes":
        return t.transpose([1, 0] + list(range(2, t.ndim)))
    return t[ex[0]]                                    # advanced indexing with an index tensor


# ---- normalisations, sorting, statistics -----------------------------------------------------------
def gen_stat(rng, shape):
    if not shape:
        return None
    forms = ["softmax_axis", "layer_norm", "logsumexp", "norm", "std", "topk", "sort", "masked_fill",
             "where_scalar", "argmax_take"]
    return {"form": str(rng.choice(forms)), "axis": _axis(rng, shape), "keepdim": bool(rng.random() < 0.5)}, []


def do_stat(t, ex, form, axis, keepdim):
    if form == "softmax_axis":
        return F.softmax(t, axis=axis)
    if form == "layer_norm":
        return F.layer_norm(t, t.shape[-1:])
    if form == "logsumexp":
        return paddle.logsumexp(t, axis=axis, keepdim=keepdim)
    if form == "norm":
        return paddle.linalg.norm(t, p=2, axis=axis, keepdim=keepdim)
    if form == "std":
        return paddle.std(t, axis=axis, keepdim=keepdim) if t.shape[axis] > 1 else t
    if form == "topk":
        return paddle.topk(t, min(2, t.shape[axis]), axis=axis)[0]
    if form == "sort":
        return paddle.sort(t, axis=axis, descending=keepdim)
    if form == "masked_fill":
        return paddle.masked_fill(t, t > 0.3, -1.0)
    if form == "where_scalar":
        return paddle.where(t > 0, t, paddle.zeros_like(t))
    i = paddle.argmax(t, axis=axis, keepdim=True)
    return paddle.take_along_axis(t, i, axis=axis)


# ---- the running value read twice (several consumers of one tensor, other layouts) --------------------
def gen_self(rng, shape):
    forms = ["t*sum", "concat_self", "t+flip"] + (["t@tT"] if len(shape) == 2 else [])
    if not shape:
        return None
    return {"form": str(rng.choice(forms)), "axis": _axis(rng, shape)}, []


def do_self(t, ex, form, axis):
    if form == "t*sum":
        return t * t.sum()
    if form == "concat_self":
        return paddle.concat([t, paddle.tanh(t)], axis=axis)
    if form == "t+flip":
        return t + paddle.flip(t, axis=[axis])
    return t @ t.T


# ---- diagonals and windows ------------------------------------------------------------------------------
def gen_diag(rng, shape):
    """A diagonal read by einsum (two equal dims), sliding windows along an axis, a diagonal embedded, a
    diagonal written (fill_diagonal_tensor of the tensor's own diagonal, doubled)."""
    if not shape:
        return None
    pairs = [(i, j) for i in range(len(shape)) for j in range(i + 1, len(shape)) if shape[i] == shape[j]]
    forms = ["unfold"] + (["einsum_diag", "fill_diag"] if pairs else []) + (["diag_embed"] if len(shape) <= 2 else [])
    form = str(rng.choice(forms))
    pair = [int(v) for v in pairs[int(rng.integers(len(pairs)))]] if pairs else [0, 0]
    axis = _axis(rng, shape)
    if form == "unfold" and shape[axis] < 2:
        return None
    return {"form": form, "axis": axis, "pair": pair}, []


def do_diag(t, ex, form, axis, pair):
    if form == "unfold":
        return t.unfold(axis, 2, 1)
    if form == "diag_embed":
        return paddle.diag_embed(t)
    if form == "fill_diag":
        return t.fill_diagonal_tensor(paddle.diagonal(t, 0, pair[0], pair[1]) * 2.0, 0, pair[0], pair[1])
    letters = "abcdefgh"[:t.ndim]
    term = "".join(letters[pair[0]] if d == pair[1] else letters[d] for d in range(t.ndim))
    return paddle.einsum(f"{term}->{term.replace(letters[pair[0]], '', 1)}", t)


# ---- scatters into a slice, counts -----------------------------------------------------------------------
def gen_scatter(rng, shape):
    """A row written back (select_scatter of the tensor's own row, scaled), a strided slice written back
    (slice_scatter), scatter_add of the tensor into itself along an axis at random rows, a cumulative trapezoid."""
    if not shape:
        return None
    axis = _axis(rng, shape)
    form = str(rng.choice(["select", "slice", "scatter_add", "cumtrap"]))
    if form == "cumtrap" and shape[axis] < 2:
        return None
    index = rng.integers(0, shape[axis], size=shape).astype("int64")
    return {"form": form, "axis": axis, "at": int(rng.integers(shape[axis]))}, \
        ([("index", index)] if form == "scatter_add" else [])


def do_scatter(t, ex, form, axis, at):
    if form == "select":
        return paddle.select_scatter(t, paddle.index_select(t, paddle.to_tensor([at]), axis).squeeze(axis) * 2.0,
                                     axis, at)
    if form == "slice":
        return paddle.slice_scatter(t, paddle.slice(t, [axis], [0], [t.shape[axis]]) * 0.5, [axis], [0],
                                    [t.shape[axis]], [1])
    if form == "scatter_add":
        return paddle.scatter_add(t, axis, ex[0], paddle.tanh(t))
    return paddle.cumulative_trapezoid(t, dx=0.5, axis=axis)


OPS = {
    "scatter": (gen_scatter, do_scatter),
    "diag": (gen_diag, do_diag),
    "self": (gen_self, do_self),
    "stat": (gen_stat, do_stat),
    "misc": (gen_misc, do_misc),
    "reshard": (gen_reshard, do_reshard),
    "reshape": (gen_reshape, do_reshape), "transpose": (gen_transpose, do_transpose),
    "flatten": (gen_flatten, do_flatten), "expand": (gen_expand, do_expand),
    "slice": (gen_slice, do_slice), "split": (gen_split, do_split),
    "binary": (gen_binary, do_binary), "unary": (gen_unary, do_unary),
    "reduce": (gen_reduce, do_reduce), "where": (gen_where, do_where),
    "concat": (gen_concat, do_concat), "inplace": (gen_inplace, do_inplace),
    "matmul": (gen_matmul, do_matmul), "gather": (gen_gather, do_gather),
}
