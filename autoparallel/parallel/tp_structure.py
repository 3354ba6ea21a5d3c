"""Tensor-parallel styles found by structure: the Megatron blocks a name table misses (an encoder-decoder's
``fc1``/``fc2`` and cross attention, a vision tower's ``qkv``/``proj``, ``linear_fc1``/``linear_fc2``...).

    plan = structural_plan(model, tp)       # {exact layer name: style}

A block is a layer holding direct ``paddle.nn.Linear`` children and nothing that could sit between them:
no parameter of its own (a gate vector, a decay table) and no direct child with a 2-D or larger parameter
other than its Linears (a conv, an embedding); norms and sublayers (an attention module beside an MLP pair)
may sit beside them. Qwen3-Next's linear attention, which also has an ``out_proj``, holds a conv and
``A_log`` / ``dt_bias`` and is no block. Its Linears must fit one of three shapes (weights ``[in, out]``):

* **MLP pair** ``A [a, f]`` -> ``B [f, c]``: A column-parallel, B row-parallel (only A produces width f);
  a gated MLP adds a second ``[a, f]`` Linear (gate and up) before ``B``;
* **attention** ``q [d, h]``, ``k [e, g]``, ``v [e, g]``, ``out [h, d]`` (``e`` differs from ``d`` in an
  encoder-decoder's cross attention): q, k, v column-parallel, out row-parallel;
* **fused attention** ``qkv [d, 3h]``, ``out [h, d]``: qkv column-parallel, out row-parallel.

The data flow is checked too where the layer's ``forward`` can be read (tp_dataflow.py): every
column-parallel Linear's output must reach a row-parallel one's input (``fc2(act(fc1(x)))``; q, k and v
reaching ``out``); two Linears of chaining shapes that read separate inputs are no pair. Names are hints only
where shapes cannot tell roles apart (four ``[d, d]`` Linears: the one named like an
output, ``out_proj``/``o_proj``/``proj``/``dense``, is ``out``; Linears named like an MLP's, ``gate``/``up``/
``down``/``fc``, are never q / k / v). Degrees: ``tp`` must divide every split width
and the block's head counts where the layer names them (``num_heads``, ``num_attention_heads``, ``heads``,
``num_key_value_heads``); a block that does not divide stays replicated. Experts stay replicated.
"""
from __future__ import annotations

from autoparallel.parallel.tensor_parallel import ColWiseParallel, RowWiseParallel, name_matches

COL, ROW = ColWiseParallel(), RowWiseParallel()
OUT_HINTS = ("out_proj", "o_proj", "proj", "dense", "out", "c_proj", "wo")
MLP_HINTS = ("gate", "up", "down", "fc", "mlp", "ffn")
HEAD_ATTRS = ("num_heads", "num_attention_heads", "heads", "n_head", "num_key_value_heads", "num_kv_heads")


def _linear_shape(layer):
    import paddle

    if type(layer) is not paddle.nn.Linear:     # plain Linears only: adapters and fused layers keep their plans
        return None
    w = layer._parameters.get("weight")
    return tuple(getattr(w, "global_shape", w.shape)) if w is not None and len(w.shape) == 2 else None


def _block_linears(layer):
    """[(child name, (in, out))] of the direct plain-Linear children of ``layer`` when nothing else it holds
    directly could sit between them: no parameter of its own (a decay table, a gate vector), no child with a
    direct parameter of two or more dims (a conv, an embedding); norms and sublayers of Linears may sit beside
    them. None otherwise."""
    import paddle

    if isinstance(layer, (paddle.nn.LayerList, paddle.nn.LayerDict)) or \
            any(p is not None for p in layer._parameters.values()):
        return None                             # a list's Linears need not feed each other
    out = []
    for name, child in layer.named_children():
        shape = _linear_shape(child)
        if shape is not None:
            out.append((name, shape))
        elif any(p is not None and len(p.shape) >= 2 for p in child._parameters.values()):
            return None
    return out if len(out) >= 2 else None


def _heads_divide(layer, tp: int) -> bool:
    for attr in HEAD_ATTRS:
        v = getattr(layer, attr, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0 and v % tp:
            return False
    return True


def _mlp(lins):
    """{child: style} of an MLP pair (or gated pair + down projection), or None."""
    if len(lins) == 2:
        (a, (_, f)), (b, (f2, _)) = lins
        return {a: COL, b: ROW} if f == f2 else None
    if len(lins) == 3:
        for i, (d, (f, _)) in enumerate(lins):
            ups = lins[:i] + lins[i + 1:]
            if ups[0][1] == ups[1][1] and ups[0][1][1] == f:
                return {ups[0][0]: COL, ups[1][0]: COL, d: ROW}
    return None


def _out_index(lins):
    """Index of the output projection of an attention block: the one named like an output when exactly one is,
    else the one Linear ``[h, d]`` facing a ``[d, h]`` (or fused ``[d, 3h]``) one."""
    hinted = [i for i, (n, _) in enumerate(lins) if n in OUT_HINTS]
    if len(hinted) == 1:
        return hinted[0]
    cand = [i for i, (_, (h, d)) in enumerate(lins)
            if any(s in ((d, h), (d, 3 * h)) for j, (_, s) in enumerate(lins) if j != i)]
    return cand[0] if len(cand) == 1 else None


def _attention(lins):
    """{child: style} of a q/k/v/out or qkv/out attention block, or None."""
    i = _out_index(lins)
    if i is None:
        return None
    out, (h, d) = lins[i]
    rest = lins[:i] + lins[i + 1:]
    if len(rest) == 1 and rest[0][1] == (d, 3 * h):
        return {rest[0][0]: COL, out: ROW}
    if len(rest) != 3 or any(h in n for n, _ in rest for h in MLP_HINTS):
        return None                             # square gate / up / down projections are no q / k / v
    q = [n for n, s in rest if s == (d, h)]
    kv = [(n, s) for n, s in rest if n not in q[:1]]
    if not q or len(kv) != 2 or kv[0][1] != kv[1][1]:
        return None
    return {q[0]: COL, kv[0][0]: COL, kv[1][0]: COL, out: ROW}


def _split_widths(styles: dict, shapes: dict):
    return [shapes[n][1] if s is COL else shapes[n][0] for n, s in styles.items()]


def block_styles(layer, tp: int):
    """{child name: style} of ``layer`` as a Megatron block at degree ``tp``, or None (see module docstring)."""
    lins = _block_linears(layer)
    if lins is None or not _heads_divide(layer, tp):
        return None
    styles = _mlp(lins) or _attention(lins)
    if not styles:
        return None
    if any(w % tp for w in _split_widths(styles, dict(lins))) or not _flows(layer, styles):
        return None
    return styles


def _flows(layer, styles: dict) -> bool:
    """Every column-parallel Linear's output reaches a row-parallel one's input in ``layer.forward``
    (tp_dataflow.py); True when that cannot be read: a Sequential (its order is its data flow), a forward
    whose source is unavailable or that calls some of the Linears elsewhere (a helper method)."""
    import paddle

    from autoparallel.parallel.tp_dataflow import call_inputs, flows_into

    if isinstance(layer, paddle.nn.Sequential):
        return True
    inputs = call_inputs(layer)
    if inputs is None or not all(n in inputs for n in styles):
        return True
    rows = [n for n, st in styles.items() if st is ROW]
    cols = [n for n, st in styles.items() if st is COL]
    return all(any(flows_into(inputs, c, r) for r in rows) for c in cols)


def structural_blocks(model, tp: int, exclude=("experts.*",)) -> list:
    """[{exact layer name: style} of one block] for every block ``block_styles`` recognises."""
    out = []
    for name, layer in model.named_sublayers(include_self=True):
        if name and any(name_matches(name, "*." + e) or name_matches(name, e) for e in exclude):
            continue
        styles = block_styles(layer, tp)
        if styles:
            out.append({f"{name}.{c}" if name else c: s for c, s in styles.items()})
    return out


def structural_plan(model, tp: int, exclude=("experts.*",)) -> dict:
    """{exact layer name: style} of every Linear in a recognised block (module docstring)."""
    return {n: s for block in structural_blocks(model, tp, exclude) for n, s in block.items()}


def plan_strings(model, plan: dict) -> list:
    """``["name: Style weight S(1) bias S(0)", ...]`` of ``plan``, in the model's layer order (bias shown only
    where the layer has one)."""
    layers = dict(model.named_sublayers())
    out = []
    for name, layer in layers.items():
        style = plan.get(name)
        if style is None:
            continue
        params = style.placements(layer)
        where = " ".join(f"{k} {v}" for k, v in params.items() if layer._parameters.get(k) is not None)
        out.append(f"{name}: {type(style).__name__} {where}".rstrip())
    return out


__all__ = ["structural_plan", "structural_blocks", "block_styles", "plan_strings"]
