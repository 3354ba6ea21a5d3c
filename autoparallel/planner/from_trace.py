"""``ModelSpec.from_trace``: a ModelSpec read off a real paddle model and its op trace.

The model's forward (plus a mean cross-entropy loss) is traced on spec-only tensors (``ap.trace``: nothing
is computed, a model built under ``paddle.LazyGuard`` is never allocated) with hooks marking where each
repeated block starts and ends, so every traced op is attributed to a block or to the rest (embeddings,
head, loss). From the parameters and that attribution:

    dimensions     hidden and vocabulary from the input embedding, layers from the block list, the FFN
                   width and gating from the block's matrices, heads from ``model.config`` or the
                   attention reshape, norms / biases / tied head / learned positions from the parameters
    per layer      parameters, forward FLOPs (matmul 2·m·n·k, other ops one per output element), bytes
                   of the ops' outputs, and the op counts the eager runtime pays per-op overheads on
                   (``OpProfile``)

The dimensions make the closed-form formulas (parameters, FLOPs, activations) apply; ``TraceFacts``
keeps the measured per-layer figures next to them so callers can compare the two.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

CORE_NAMES = ("causal_attention", "scaled_dot_product_attention", "attention_core")
_MATMUL_OPS = ("matmul", "linear", "bmm")


@dataclass(frozen=True)
class TraceFacts:
    """Per-layer figures measured on the op trace (forward, one micro-batch of ``batch`` x ``seq_len``)."""
    batch: int
    seq_len: int
    layer_params: int             # parameters of one block
    layer_flops: float            # forward FLOPs of one block (matmuls + one per element of other ops)
    layer_matmul_flops: float     # forward matmul FLOPs of one block
    layer_activation_bytes: float  # bytes of the outputs of one block's ops
    outside_flops: float          # forward FLOPs outside the blocks (embeddings, head, loss)
    outside_matmul_flops: float   # matmul FLOPs outside the blocks (the LM head)
    outside_activation_bytes: float


def _find_blocks(model):
    import paddle

    for name, layer in model.named_sublayers():
        if isinstance(layer, paddle.nn.LayerList) and len(layer):
            return name, list(layer)
    raise ValueError(f"ModelSpec.from_trace needs the model's repeated blocks in a paddle.nn.LayerList; "
                     f"{type(model).__name__} has none")


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class _Marks:
    """Forward hooks recording the tracer's op counter when each block (and attention core) starts/ends."""

    def __init__(self, blocks):
        from autoparallel.graph import trace as trace_state

        self.state = trace_state
        self.spans = [[None, None] for _ in blocks]
        self.core = []
        self.handles = []
        for i, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._pre(i)))
            self.handles.append(block.register_forward_post_hook(self._post(i)))

    def _count(self):
        return self.state.active().count

    def _pre(self, i):
        def hook(_layer, _inputs):
            self.spans[i][0] = self._count()
        return hook

    def _post(self, i):
        def hook(_layer, _inputs, _outputs):
            self.spans[i][1] = self._count()
        return hook

    def wrap_core(self, fn):
        def wrapped(*args, **kwargs):
            start = self._count()
            out = fn(*args, **kwargs)
            self.core.append(self._count() - start)
            return out
        return wrapped

    def remove(self):
        for h in self.handles:
            h.remove()


def _attention_layer(block):
    """The block's attention sublayer: the first named like '*attn*' or '*attention*' (as recompute finds it)."""
    for name, layer in block.named_sublayers():
        last = name.split(".")[-1]
        if "attn" in last or "attention" in last:
            return layer
    return None


def _core_module(block):
    """(module, function name) of the block's attention core, as selective recompute finds it."""
    layer = _attention_layer(block)
    if layer is None:
        return None, None
    mod = sys.modules[type(layer).__module__]
    fn = next((n for n in CORE_NAMES if callable(getattr(mod, n, None))), None)
    return (mod, fn) if fn is not None else (None, None)


def trace_model(model, seq_len: int, batch: int):
    """(graph, block spans [(start, end)], attention-core op count) of ``model`` plus its loss."""
    import paddle
    import paddle.nn.functional as F

    from autoparallel.graph.trace import trace
    from autoparallel.core.mesh import ProcessMesh
    from autoparallel.core.placement import Replicate
    from autoparallel.core.spec import DistSpec

    class WithLoss(paddle.nn.Layer):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids, labels):
            return traced_loss(self.inner, ids, labels, F.cross_entropy)

    _, blocks = _find_blocks(model)
    marks = _Marks(blocks)
    mod, fn = _core_module(blocks[0])
    original = getattr(mod, fn) if mod is not None else None
    if mod is not None:
        setattr(mod, fn, marks.wrap_core(original))
    mesh = ProcessMesh([0], dim_names=["data"], create_groups=False)
    spec = DistSpec(mesh, (Replicate(),), (batch, seq_len), "int64")
    try:
        graph = trace(WithLoss(model), spec, spec)
    finally:
        marks.remove()
        if mod is not None:
            setattr(mod, fn, original)
    if any(a is None or b is None for a, b in marks.spans):
        raise ValueError(f"ModelSpec.from_trace: the forward of {type(model).__name__} did not call every block "
                         f"of its LayerList")
    core = marks.core[0] if marks.core else 0
    return graph, [tuple(s) for s in marks.spans], core


def traced_loss(model, ids, labels, cross_entropy):
    """The loss a training step computes: the model's own when its forward takes ``labels`` and returns a loss
    (PaddleFormers / Hugging Face causal LMs), else the cross-entropy of its logits. Token ids go in as
    ``input_ids=`` when the forward names it, else positionally."""
    import inspect

    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        names = {}
    ids_kw = {"input_ids": ids} if "input_ids" in names else {}
    args = () if ids_kw else (ids,)
    if "labels" in names:
        out = model(*args, labels=labels, **ids_kw)
        loss = _loss_in(out)
        if loss is not None:
            return loss
    else:
        out = model(*args, **ids_kw)
    return cross_entropy(logits_of(out), labels)


def _loss_in(out):
    """A scalar loss in a forward's output (a 0-d tensor, ``loss`` of a ModelOutput / dict, or first of a tuple)."""
    from autoparallel.dist_tensor import DistTensor

    if isinstance(out, dict) or hasattr(out, "loss"):
        out = out.get("loss") if isinstance(out, dict) else out.loss
    elif isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out if isinstance(out, DistTensor) and len(out.shape) == 0 else None


def logits_of(out):
    """The logits of a forward's output: a tensor, a ModelOutput / dict with ``logits``, or a tuple whose first
    tensor is the logits (a causal LM returns (loss, logits, ...) only when given labels)."""
    from autoparallel.dist_tensor import DistTensor

    if isinstance(out, DistTensor):
        return out
    if isinstance(out, dict) or hasattr(out, "logits"):
        logits = out.get("logits") if isinstance(out, dict) else out.logits
        if isinstance(logits, DistTensor):
            return logits
    if isinstance(out, (tuple, list)):
        first = next((x for x in out if isinstance(x, DistTensor)), None)
        if first is not None:
            return first
    raise TypeError(f"ModelSpec.from_trace: the model's forward returned {type(out).__name__}; expected the logits "
                    f"as a tensor, a ModelOutput or dict with 'logits', or a tuple starting with them")


def _node_sums(graph, nodes):
    flops = matmul = out_bytes = 0.0
    for n in nodes:
        d = graph.nodes[n]
        flops += d["flops"]
        if d["op"] in _MATMUL_OPS:
            matmul += d["flops"]
        out_bytes += sum(s.nbytes for s in d["outputs"] if s is not None)
    return flops, matmul, out_bytes


# ---- dimensions from parameters -------------------------------------------------------------------------
def _linears(layer):
    import paddle

    return [(n, l) for n, l in layer.named_sublayers() if isinstance(l, paddle.nn.Linear)]


def _norms(layer):
    return [(n, l) for n, l in layer.named_sublayers() if type(l).__name__.endswith("Norm")]


def _embeddings(model):
    import paddle

    return [(n, l) for n, l in model.named_sublayers() if isinstance(l, paddle.nn.Embedding)]


def _heads_from_config(model):
    c = getattr(model, "config", None)
    heads = getattr(c, "heads", None) or getattr(c, "num_attention_heads", None)
    kv = getattr(c, "kv_heads", None) or getattr(c, "num_key_value_heads", None) or heads
    return heads, kv


def _heads_from_trace(graph, spans, hidden):
    """Heads from the first 4-d reshape inside the first block: [b, s, heads, x]."""
    start, end = spans[0]
    for n in range(start, end):
        d = graph.nodes[n]
        out = d["outputs"][0] if d["outputs"] else None
        if d["op"] == "reshape" and out is not None and len(out.shape) == 4 and hidden % out.shape[2] == 0:
            return int(out.shape[2])
    return None


def dimensions(model, graph, spans) -> dict:
    """ModelSpec keyword arguments (without name and seq_len) read off the parameters and the trace."""
    _, blocks = _find_blocks(model)
    embeddings = _embeddings(model)
    block_ids = {id(p) for b in blocks for p in b.parameters()}
    outside_embeddings = [(n, e) for n, e in embeddings if id(e.weight) not in block_ids]
    if not outside_embeddings:
        raise ValueError(f"ModelSpec.from_trace needs an input embedding (paddle.nn.Embedding) in "
                         f"{type(model).__name__}")
    vocab, hidden = (int(x) for x in outside_embeddings[0][1].weight.shape)
    positions = [int(e.weight.shape[0]) for _, e in outside_embeddings[1:] if int(e.weight.shape[1]) == hidden]
    block = blocks[0]
    heads, kv_heads = _heads_from_config(model)
    if heads is None:
        heads = _heads_from_trace(graph, spans, hidden)
        kv_heads = heads
    if heads is None:
        raise ValueError(f"ModelSpec.from_trace cannot tell the attention heads of {type(model).__name__}: give "
                         f"the model a config with 'heads' (and 'kv_heads')")
    attention = _attention_layer(block)
    inside = {id(l) for _, l in _linears(attention)} if attention is not None else set()
    mlp = [l for _, l in _linears(block) if id(l) not in inside]
    ffn, gated = _mlp_width(model, block, mlp, hidden)
    norms = _norms(block)
    layernorm = any(getattr(n, "bias", None) is not None for _, n in norms)
    c = getattr(model, "config", None)
    dropout = bool(getattr(c, "dropout", 0.0) or 0.0)
    from autoparallel.planner.latent_attention import mla_fields

    mla = mla_fields(model, int(heads))                 # multi-head latent attention's ranks and head widths
    kv_heads = mla.pop("kv_heads", kv_heads)
    return dict(hidden=hidden, layers=len(blocks), heads=int(heads), vocab=vocab, ffn=ffn, **mla,
                kv_heads=int(kv_heads or heads), swiglu=gated,
                bias=any(l.bias is not None for _, l in _linears(block)), layernorm=layernorm,
                tied_embeddings=head_tied(model, blocks, hidden, vocab), learned_positions=bool(positions),
                positions=positions[0] if positions else 0, dropout=dropout,
                attn_dim=config_attn_dim(model, hidden, int(heads)))


def config_attn_dim(model, hidden: int, heads: int) -> int:
    """heads·config.head_dim when hidden does not divide into the heads (Qwen3, Gemma 3, ERNIE 4.5 set head_dim
    apart from hidden: hidden 40 with 3 heads of 8), else 0: ``fit_attention_width`` then picks the reading that
    explains the parameter count."""
    head_dim = getattr(getattr(model, "config", None), "head_dim", None)
    if hidden % heads and isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim > 0:
        return heads * head_dim
    return 0


def head_tied(model, blocks, hidden: int, vocab: int) -> bool:
    """True when no parameter outside the blocks but the input embedding is a [h, V] or [V, h] output head."""
    block_ids = {id(p) for b in blocks for p in b.parameters()}
    embedding_ids = {id(e.weight) for _, e in _embeddings(model)}
    return not any(id(p) not in block_ids and id(p) not in embedding_ids
                   and tuple(int(x) for x in p.shape) in ((hidden, vocab), (vocab, hidden)) for p in model.parameters())


def _mlp_width(model, block, mlp, hidden):
    """(inner width, gated) of the block's MLP: one inner width shared by its matrices (gated with three
    matrices), or ``config.intermediate_size`` when the matrices show it and twice it (a fused [gate | up])."""
    widths = sorted({int(x) for l in mlp for x in l.weight.shape if int(x) != hidden})
    if len(widths) == 1:
        return widths[0], len(mlp) == 3
    inner = getattr(getattr(model, "config", None), "intermediate_size", None)
    if isinstance(inner, int) and widths == sorted({inner, 2 * inner}):
        return inner, True
    raise ValueError(f"ModelSpec.from_trace expects the MLP matrices of a block to share one inner width (or a "
                     f"fused [gate | up] of twice config.intermediate_size), got {widths} in {type(block).__name__}")


# ---- op profile --------------------------------------------------------------------------------------
def op_profile(model, spans, core_ops: int, total_ops: int):
    """The counts the eager runtime pays per-op overheads on (see model_spec.OpProfile)."""
    from autoparallel.planner.model_spec import OpProfile

    _, blocks = _find_blocks(model)
    counts = [b - a for a, b in spans]
    block_ops = round(sum(counts) / len(counts))      # blocks of different kinds (sliding / full attention): mean
    owners = _param_owners
    block_ids = {id(p) for b in blocks for p in b.parameters()}
    outside_tensors = [p for p in model.parameters() if id(p) not in block_ids]
    outside_owners = [l for l in owners(model) if not set(id(p) for p in l.parameters(include_sublayers=False))
                      <= block_ids]
    row, col = _tp_linears(model, blocks[0])
    return OpProfile(layer_ops=block_ops, outside_ops=total_ops - block_ops * len(blocks), core_ops=core_ops,
                     layer_tensors=len(list(blocks[0].parameters())), outside_tensors=len(outside_tensors),
                     layer_param_layers=len(owners(blocks[0])), outside_param_layers=len(outside_owners),
                     row_parallel=row, col_parallel=col)


def _param_owners(layer) -> list:
    """``layer`` and its sublayers that own parameters themselves (ZeRO-3 gathers once per such layer)."""
    return [l for l in [layer] + [s for _, s in layer.named_sublayers()] if l.parameters(include_sublayers=False)]


def _tp_linears(model, block):
    """(row-parallel, column-parallel) linears of one block under the default tensor-parallel plan."""
    from autoparallel.parallel.model_families import DEFAULT_PLANS, default_family, matches
    from autoparallel.parallel.tensor_parallel import ColWiseParallel, RowWiseParallel, match_plan

    family = default_family(model)
    if family is None:
        return 0, 0
    prefix = next(n for n, l in model.named_sublayers() if l is block) + "."
    plan = {p: s for p, s in DEFAULT_PLANS[family].items() if matches(model, p)}
    hits = [style for name, _, style in match_plan(model, plan) if name.startswith(prefix)]
    return (sum(isinstance(s, RowWiseParallel) for s in hits), sum(isinstance(s, ColWiseParallel) for s in hits))


def from_trace(model, seq_len: int, batch: int, name: str = "traced"):
    """A ModelSpec of ``model`` with its per-layer trace figures (see the module docstring)."""
    from autoparallel.planner.model_spec import ModelSpec

    _positive("seq_len", seq_len)
    _positive("batch", batch)
    if not hasattr(model, "named_sublayers"):
        raise TypeError(f"ModelSpec.from_trace expects a paddle.nn.Layer, got {type(model).__name__}")
    graph, spans, core = trace_model(model, seq_len, batch)
    dims = dimensions(model, graph, spans)
    ops = op_profile(model, spans, core, graph.number_of_nodes())
    start, end = spans[0]
    layer_flops, layer_mm, layer_bytes = _node_sums(graph, range(start, end))
    inside = {n for a, b in spans for n in range(a, b)}
    out_flops, out_mm, out_bytes = _node_sums(graph, [n for n in graph.nodes if n not in inside])
    _, blocks = _find_blocks(model)
    facts = TraceFacts(batch=batch, seq_len=seq_len,
                       layer_params=sum(math.prod(p.shape) for p in blocks[0].parameters()),
                       layer_flops=layer_flops, layer_matmul_flops=layer_mm, layer_activation_bytes=layer_bytes,
                       outside_flops=out_flops, outside_matmul_flops=out_mm, outside_activation_bytes=out_bytes)
    spec = ModelSpec(name, seq_len=int(seq_len), ops=ops, traced=facts, **dims)
    counts = sorted({b - a for a, b in spans})
    mean = "" if len(counts) == 1 else f" (blocks differ: {counts} ops, mean taken)"
    source = (f"traced: forward ops, FLOPs and activation bytes per block{mean}; dimensions from the parameters "
              f"(hidden, vocab, FFN width) and {'model.config' if _heads_from_config(model)[0] else 'the trace'} "
              f"(heads)")
    return with_residual(fit_attention_width(spec, model), model, source)


def fit_attention_width(spec, model):
    """``spec`` with ``attn_dim = heads·config.head_dim`` when the config sets a head_dim that makes it differ
    from hidden and that reading explains the parameter count better (Qwen3, ERNIE 4.5)."""
    from dataclasses import replace

    head_dim = getattr(getattr(model, "config", None), "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0 or spec.heads * head_dim == spec.hidden:
        return spec
    wide = replace(spec, attn_dim=spec.heads * head_dim)
    counted = counted_params(model)
    return wide if abs(counted - wide.params) < abs(counted - spec.params) else spec


def counted_params(model) -> int:
    return sum(int(np.prod(p.shape)) for p in {id(p): p for p in model.parameters()}.values())


def with_residual(spec, model, source: str):
    """``spec`` with the model's real parameter count: what the closed form misses (or over-counts) per block
    becomes ``extra_layer_params`` (priced replicated); more than half the model unexplained is refused."""
    from dataclasses import replace

    counted = counted_params(model)
    residual = counted - spec.params
    if abs(residual) > counted / 2:
        raise ValueError(f"{type(model).__name__} has {counted} parameters but its inferred dimensions "
                         f"({spec.short_dims()}) give {spec.params}; the model is not a decoder-only transformer "
                         f"of the form ModelSpec describes")
    if residual:
        source += (f"; {residual:+d} parameters ({residual / spec.layers:+.0f} per block) beyond the closed form, "
                   f"priced replicated")
    out = replace(spec, extra_layer_params=residual / spec.layers, source=source)
    assert out.params == counted, (out.params, counted)
    return out
