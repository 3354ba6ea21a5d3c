"""Cross entropy over sharded logits, reducing exactly as paddle's ``F.cross_entropy`` does on one process.

paddle 3.3's ``reduction='mean'`` divides the sum of the (class-weighted) per-example losses by:

* ``ignore_index >= 0``: the number of label elements other than ``ignore_index`` (with ``weight``: the sum of
  their class weights), a zero divisor counting as 1;
* ``ignore_index < 0`` with ``weight``: the class-weight sum of the examples whose label is not ``ignore_index``,
  a zero divisor counting as 1;
* ``ignore_index < 0`` without ``weight`` (the default -100): the number of examples, ignored ones INCLUDED.

Each divisor is a sum over examples, so the terms of batch shards add up: a shard sums its losses, the divisor
terms are all-reduced over the batch mesh dims, and the quotient is a Partial(sum) term of the global mean. A
shard with every label ignored contributes 0 to both. Group ops: ``fn(mesh, calls: {rank: (args, kwargs)})``.
"""
from __future__ import annotations

import paddle
import paddle.nn.functional as F

from autoparallel.comm import collectives as C

_CE_NAMES = ["input", "label", "weight", "ignore_index", "reduction", "soft_label", "axis", "use_softmax",
             "label_smoothing", "name"]              # paddle.nn.functional.cross_entropy's order


def mesh_reduce(xs, mesh, dims, op="sum"):
    """All-reduce ``{rank: tensor}`` over each mesh dim of ``dims`` in turn."""
    for d in dims:
        out = {}
        for ranks in mesh.all_groups(d):
            held = {r: xs[r] for r in ranks if r in xs}
            if held:
                out.update(C.all_reduce(held, ranks, op))
        xs = out
    return xs


def ce_kwargs(args, kwargs) -> dict:
    bound = dict(zip(_CE_NAMES, args))
    bound.update(kwargs)
    bound.setdefault("ignore_index", -100)
    bound.setdefault("reduction", "mean")
    bound.setdefault("axis", -1)
    bound.setdefault("label_smoothing", 0.0)
    return bound


def check_ids(x, size, what: str, allowed=(-1,), error=ValueError) -> None:
    """Raise ``error`` (paddle's class: ValueError for embedding ids, IndexError for labels) when an id of ``x``
    is outside [0, size) and not in ``allowed`` (paddle's embedding kernel takes -1 as its padding row).
    Dynamic mode only: a static program's values are unknown while it is built."""
    if size is None or not paddle.in_dynamic_mode() or x.numel() == 0:
        return
    bad = (x >= size) | (x < 0)
    for a in allowed:
        bad = bad & (x != a)
    if bool(bad.any()):
        raise error(f"{what} must be in [0, {size}) (paddle's kernel checks this on one process; split over the "
                    f"ranks, an id no rank holds would count silently as a zero), got {x.masked_select(bad)[:4].tolist()}")


def _keepdim_label(label, nd, a):
    """A hard label with a 1 at the class axis (paddle accepts it with or without)."""
    return label if label.ndim == nd else label.unsqueeze(a)


def _class_view(t, nd, a):
    """A [C] tensor shaped to broadcast along class axis ``a`` of an ``nd``-dim tensor."""
    shape = [1] * nd
    shape[a] = -1
    return t.reshape(shape)


def _hard_weight(weight, lab, valid):
    """``weight[label]`` where the label is valid, 0 elsewhere (paddle's ``weight_gather``)."""
    safe = paddle.where(valid, lab, paddle.zeros_like(lab)).astype("int64")
    return paddle.gather(weight, safe.reshape([-1])).reshape(lab.shape) * valid.astype(weight.dtype)


def sum_both(xs, mesh, dims):
    """Sum over ``dims`` whose backward sums the ranks' gradients too: every rank's loss term divides by the
    global divisor, so a class weight's gradient through it is the sum of all terms' (``all_reduce``'s
    identity adjoint would keep one rank's term)."""
    for d in dims:
        out = {}
        for ranks in mesh.all_groups(d):
            held = {r: xs[r] for r in ranks if r in xs}
            if held:
                both = lambda v, ranks=ranks: C._reduce_raw(v, ranks, "sum")
                out.update(C._run(held, both, both))
        xs = out
    return xs


def _count(t):
    """The number of elements of ``t`` as a float32 tensor (an op, so a static program computes it too)."""
    return paddle.ones_like(t, dtype="float32").sum()


def _divisor(loss, terms, guarded, mesh, batch_dims):
    """The global mean: local loss sum over the all-reduced divisor ``terms`` (zero counts as 1 if guarded)."""
    d = sum_both({r: t.astype("float32") for r, t in terms.items()}, mesh, batch_dims)
    if guarded:
        d = {r: v + (v == 0.0).astype(v.dtype).detach() for r, v in d.items()}
    return {r: loss[r].sum() / d[r].astype(loss[r].dtype) for r in loss}


def _mean_terms(b, a):
    """One rank's term of paddle's mean divisor on a full class axis: (tensor, guarded)."""
    lab, weight, ignore = b["label"], b.get("weight"), b["ignore_index"]
    x = b["input"]
    nd = x.ndim
    soft = bool(b.get("soft_label")) or b["label_smoothing"] > 0
    if not soft:
        lab = _keepdim_label(lab, nd, a)
        valid = lab != ignore
        if weight is not None:
            return _hard_weight(weight, lab, valid).sum(), True
        if ignore >= 0:
            return valid.astype("float32").sum(), True
        return _count(lab), False
    y = lab
    if not b.get("soft_label"):                      # paddle turns a smoothed hard label into a soft one
        y = F.label_smooth(F.one_hot(lab.squeeze(a) if lab.ndim == nd else lab, x.shape[a]),
                           epsilon=b["label_smoothing"])
    y = y.astype(x.dtype)
    if weight is not None:
        wg = (y * _class_view(weight, nd, a)).sum(axis=a, keepdim=True)
        if ignore >= 0:
            return ((y != ignore).astype(wg.dtype) * wg).sum(), True
        return wg.sum(), True
    if ignore >= 0:
        return (y != ignore).astype("float32").sum(), True
    return _count(y.sum(axis=a)), False


def global_mean_cross_entropy(mesh, calls):
    """Mean cross entropy over a batch sharded on ``batch_mesh_dims`` (class axis whole on every rank): the
    local sum of paddle's own per-example losses over the global divisor (see the module docstring)."""
    sums, terms, guarded = {}, {}, False
    dims = ()
    for r, (args, kwargs) in calls.items():
        b = ce_kwargs(args, kwargs)
        dims = b.pop("batch_mesh_dims")
        a = b["axis"] % b["input"].ndim
        loss = F.cross_entropy(**{k: v for k, v in b.items() if k not in ("name", "reduction")}, reduction="none")
        sums[r] = loss
        terms[r], guarded = _mean_terms(b, a)
    return _divisor(sums, terms, guarded, mesh, dims)


def vocab_parallel_cross_entropy(mesh, calls):
    """Cross entropy with the class axis sharded over ``class_mesh_dims``: the max logit, the sum of
    exponentials and the label's logit (soft labels and label smoothing: their dot products) are all-reduced
    over the class mesh dims; the logits are never gathered. With the batch sharded too the result is a
    Partial(sum) term over ``batch_mesh_dims``."""
    bound = {r: ce_kwargs(*c) for r, c in calls.items()}
    b0 = next(iter(bound.values()))
    _check_vocab_parallel(b0)
    nd = b0["input"].ndim
    a = b0["axis"] % nd
    cdims = b0["class_mesh_dims"]
    x = {r: b["input"] for r, b in bound.items()}
    with paddle.no_grad():
        lmax = mesh_reduce({r: _class_max(t, a) for r, t in x.items()}, mesh, cdims, "max")
    sh = {r: x[r] - lmax[r].detach() for r in x}
    sumexp = mesh_reduce({r: paddle.exp(t).sum(axis=a, keepdim=True) for r, t in sh.items()}, mesh, cdims)
    lse = {r: paddle.log(sumexp[r]) for r in sh}
    if b0.get("soft_label"):
        loss, wg = _soft_terms(bound, sh, lse, mesh, cdims, a)
    else:
        loss, wg = _hard_terms(bound, sh, lse, mesh, cdims, a)
    reduction = b0["reduction"]
    if reduction == "none":
        squeeze = not b0.get("soft_label") and not b0["label_smoothing"] and b0["label"].ndim == nd - 1
        return {r: t.squeeze(a) if squeeze else t for r, t in loss.items()}
    if reduction == "sum":
        return {r: t.sum() for r, t in loss.items()}
    if wg is not None:
        return _divisor(loss, {r: w.sum() for r, w in wg.items()}, True, mesh, b0["batch_mesh_dims"])
    if b0["ignore_index"] >= 0:
        terms = {r: (_keepdim_label(b["label"], nd, a) != b["ignore_index"]).astype("float32").sum()
                 for r, b in bound.items()}
        return _divisor(loss, terms, True, mesh, b0["batch_mesh_dims"])
    terms = {r: _count(t) for r, t in loss.items()}
    return _divisor(loss, terms, False, mesh, b0["batch_mesh_dims"])


def _class_max(t, a):
    """The max over class axis ``a`` (kept); -inf for a rank holding no class (6 classes over 4 ranks are 2, 2,
    2, 0: paddle refuses a max over an empty axis)."""
    if t.shape[a] > 0:
        return paddle.max(t, axis=a, keepdim=True)
    shape = list(t.shape)
    shape[a] = 1
    return paddle.full(shape, float("-inf"), dtype=t.dtype)


def _pick(t, idx, a):
    """``take_along_axis(t, idx, a)``; zeros of the label's shape on a rank holding no class."""
    if t.shape[a] > 0:
        return paddle.take_along_axis(t, idx, axis=a)
    return paddle.zeros(idx.shape, dtype=t.dtype) + t.sum() * 0


def _check_vocab_parallel(b) -> None:
    if b.get("use_softmax") is False:
        raise NotImplementedError("vocab-parallel cross_entropy: use_softmax=False (the input holds "
                                  "probabilities) is not supported with the class axis sharded; gather the "
                                  "class axis (ap.reshard to Replicate) or pass logits")
    if (b.get("soft_label") or b["label_smoothing"] > 0) and b["ignore_index"] >= 0:
        raise NotImplementedError(f"vocab-parallel cross_entropy: ignore_index={b['ignore_index']} with a soft or "
                                  f"smoothed label (paddle's mean then counts soft-label elements) is not supported "
                                  f"with the class axis sharded; use ignore_index=-100")


def _hard_terms(bound, sh, lse, mesh, cdims, a):
    """Per-example losses (keepdim at the class axis) and class weights (None without ``weight``)."""
    nd = next(iter(sh.values())).ndim
    picked, rowsum, loss, wg = {}, {}, {}, {}
    eps = next(iter(bound.values()))["label_smoothing"]
    for r, b in bound.items():
        lab = _keepdim_label(b["label"], nd, a)
        check_ids(lab, b["class_count"], f"cross_entropy: labels other than ignore_index={b['ignore_index']}",
                  allowed=(b["ignore_index"],), error=IndexError)
        start, end = b["class_start"], b["class_end"]
        inside = (lab >= start) & (lab < end)
        idx = paddle.where(inside, lab - start, paddle.zeros_like(lab)).astype("int64")
        got = _pick(sh[r], idx, a)
        picked[r] = got * inside.astype(got.dtype)
        if eps > 0:
            rowsum[r] = sh[r].sum(axis=a, keepdim=True)
    picked = mesh_reduce(picked, mesh, cdims)
    if eps > 0:
        rowsum = mesh_reduce(rowsum, mesh, cdims)
    for r, b in bound.items():
        lab = _keepdim_label(b["label"], nd, a)
        valid = lab != b["ignore_index"]
        nll = lse[r] - picked[r]
        if eps > 0:
            _check_smoothed_labels(lab, b["class_count"])
            loss[r] = (1.0 - eps) * nll + eps * (lse[r] - rowsum[r] / b["class_count"])
        else:
            loss[r] = nll * valid.astype(nll.dtype)
        w = b.get("weight")
        if w is not None:                            # this rank's classes only: the class weight's gradient
            start, end = b["class_start"], b["class_end"]          # is summed over the class dims
            mine = valid & (lab >= start) & (lab < end)
            wg[r] = _hard_weight(w, lab, mine) if eps == 0 else \
                (1.0 - eps) * _hard_weight(w, lab, mine) + eps * w[start:end].sum() / b["class_count"]
    if not wg:
        return loss, None
    wg = mesh_reduce(wg, mesh, cdims)
    return {r: loss[r] * wg[r].astype(loss[r].dtype) for r in loss}, wg


def _check_smoothed_labels(lab, classes) -> None:
    if not paddle.in_dynamic_mode():                 # a static program's values are not known while it is built
        return
    if bool(((lab < 0) | (lab >= classes)).any()):
        raise ValueError(f"cross_entropy with label_smoothing: every label must be a class index in [0, {classes}) "
                         f"(paddle one-hot encodes it; an ignore_index label cannot be smoothed)")


def _soft_terms(bound, sh, lse, mesh, cdims, a):
    """Soft labels sharded with the classes: -sum(y * log_softmax) = lse * sum(y) - sum(y * shifted)."""
    nd = next(iter(sh.values())).ndim
    ysum, ydot, wpart = {}, {}, {}
    for r, b in bound.items():
        y = b["label"].detach().astype(sh[r].dtype)
        ysum[r] = y.sum(axis=a, keepdim=True)
        ydot[r] = (y * sh[r]).sum(axis=a, keepdim=True)
        if b.get("weight") is not None:
            w = b["weight"][b["class_start"]:b["class_end"]]
            wpart[r] = (y * _class_view(w, nd, a).astype(y.dtype)).sum(axis=a, keepdim=True)
    ysum, ydot = mesh_reduce(ysum, mesh, cdims), mesh_reduce(ydot, mesh, cdims)
    loss = {r: lse[r] * ysum[r] - ydot[r] for r in bound}
    if not wpart:
        return loss, None
    wg = mesh_reduce(wpart, mesh, cdims)
    return {r: loss[r] * wg[r] for r in loss}, wg
