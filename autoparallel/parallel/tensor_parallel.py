"""Tensor-parallel plans: plain dicts from layer-name patterns to styles (torchtitan style).

    plan = {"blocks.*.attn.qkv": ColWiseParallel(), "blocks.*.attn.proj": RowWiseParallel(),
            "blocks.*.mlp.fc1": ColWiseParallel(), "blocks.*.mlp.fc2": RowWiseParallel(),
            "wte": VocabParallelEmbedding(), "blocks.*.ln*": SequenceParallel()}
    apply_tp(model, mesh, plan, tp_dim="model")

A pattern matches a layer's full name or any dotted suffix of it (``self_attn.q_proj`` matches
``model.layers.0.self_attn.q_proj``), with ``*`` as in fnmatch. Each style shards its layer's parameters on
the TP mesh dim and pins its input/output layouts with forward hooks, so the collectives are exactly
Megatron's: column-parallel takes a replicated input (all_gather under sequence parallel) and gives a
feature-sharded output; row-parallel takes the feature shard and gives a replicated output (one all_reduce)
or a sequence-sharded one (reduce_scatter).

Styles attach to leaf layers only. ``paddle.nn.Linear`` stores its weight ``[in, out]``; any other leaf layer
with a 2-D ``weight`` (an embedding, a ``[vocab, hidden]`` LM head) stores ``[out, in]``, so ColWiseParallel on
such a head shards its first dim: the vocabulary. Tied parameters stay one parameter (parallel/ties.py).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, fields

from autoparallel.config.fields import integral
from autoparallel.dist_tensor import DistTensor, is_dist, reshard, shard_tensor
from autoparallel.parallel.tp_adapters import adapter_targets, base_linear, is_adapter_wrapper
from autoparallel.placement import Partial, Replicate, Shard


class PlanError(ValueError):
    """A tensor-parallel plan entry that cannot be applied (unknown layer, wrong layer type)."""


def _with(placements, dim, p):
    out = list(placements)
    out[dim] = p
    return out


def _relayout(x, dim, p):
    """Reshard a DistTensor so mesh dim ``dim`` has placement ``p`` (other dims unchanged)."""
    if not isinstance(x, DistTensor):
        return x
    if x.placements[dim] == p:
        return x
    return reshard(x, x.mesh, _with(x.placements, dim, p))


def _for_split(x, dim):
    """``x`` replicated on mesh dim ``dim`` for a layer split over it: one all_gather shared by every such
    layer reading ``x`` and one reduce_scatter of their summed partial gradients (comm/fanout.py)."""
    if not isinstance(x, DistTensor) or x.placements[dim] == Replicate():
        return x
    if any(p.is_partial() for p in x.placements):
        return _relayout(x, dim, Replicate())
    from autoparallel.comm.fanout import replicate_for_split

    return replicate_for_split(x, dim)


def _relayout_all(args, kwargs, fn):
    return tuple(fn(x) for x in args), {k: fn(v) for k, v in kwargs.items()}


def _shard_param(layer, name, mesh, dim, p):
    param = getattr(layer, name, None)
    if param is None or is_dist(param):      # already laid out by the user (or a tied holder): theirs wins
        return
    setattr(layer, name, shard_tensor(param, mesh, _with([Replicate()] * mesh.ndim, dim, p)))


def _shard_targets(style, layer, mesh, dim, column: bool) -> None:
    """The style's placements on the base Linear's parameters (``layer`` itself, or the Linear a LoRA wrapper
    adapts) and the adapter's split matching the base weight (parallel/tp_adapters.py)."""
    base = base_linear(layer) or layer
    placements = style.placements(base)
    for pname, p in placements.items():
        _shard_param(base, pname, mesh, dim, p)
    for holder, pname, p in adapter_targets(layer, placements["weight"], column):
        _shard_param(holder, pname, mesh, dim, p)


def _is_linear(layer) -> bool:
    from paddle import nn

    return isinstance(layer, nn.Linear)


def _weight_2d(layer):
    w = layer._parameters.get("weight")
    return w if w is not None and len(getattr(w, "global_shape", w.shape)) == 2 else None


def _check_leaf(style, name, layer, need_weight=True):
    kids = [n for n, _ in layer.named_children()]
    if kids and need_weight and is_adapter_wrapper(layer):      # a LoRA wrapper: its base Linear is the leaf
        return
    if kids:
        raise PlanError(f"{type(style).__name__} attaches to leaf layers (Linear, Embedding, an LM head), but "
                        f"{name!r} is a {type(layer).__name__} holding sublayers {kids[:6]}; name its Linear layers "
                        f"instead (for example {name + '.' + kids[0]!r})")
    if need_weight and _weight_2d(layer) is None:
        raise PlanError(f"{type(style).__name__} shards a 2-D weight, but {name!r} ({type(layer).__name__}) has none; "
                        f"use it on a Linear, Embedding or [vocab, hidden] head layer")


class _Style:
    """Field checks shared by the styles: flags are bools, ``seq_dim`` an int >= 0."""

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in (bool, "bool") and not isinstance(v, bool):
                raise TypeError(f"{type(self).__name__}({f.name}=...) expects True or False, got "
                                f"{type(v).__name__} {v!r}")
            if f.name == "seq_dim" and integral(v) is not None:             # numpy's too
                v = integral(v)
                object.__setattr__(self, f.name, v)
            if f.name == "seq_dim" and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"{type(self).__name__}(seq_dim=...) expects a tensor dim (an int >= 0), got "
                                f"{type(v).__name__} {v!r}")
            if f.name == "seq_dim" and v < 0:
                raise ValueError(f"{type(self).__name__}(seq_dim=...) expects a tensor dim (an int >= 0), got {v}")


@dataclass(frozen=True)
class ColWiseParallel(_Style):
    """Output features split. Linear [in, out]: weight S(1), bias S(0); an [out, in] weight (LM head
    [vocab, hidden]): weight S(0), bias S(0). Input replicated on the TP dim (all_gather if it was
    sequence-sharded); output sharded on the feature (last) dim, or gathered back to replicated with
    ``gather_output=True`` (for fused projections whose output the model slices in blocks). Positional order
    as paddle's ``ColWiseParallel(gather_output=False)``; ``sequence_parallel`` is keyword-only."""
    gather_output: bool = False
    sequence_parallel: bool = field(default=False, kw_only=True)

    def check(self, name, layer):
        _check_leaf(self, name, layer)

    def placements(self, layer) -> dict:
        return {"weight": Shard(1) if _is_linear(layer) else Shard(0), "bias": Shard(0)}

    def apply(self, layer, mesh, dim):
        _shard_targets(self, layer, mesh, dim, column=True)
        layer.register_forward_pre_hook(
            lambda _l, args, kwargs: _relayout_all(args, kwargs, lambda x: _for_split(x, dim)), with_kwargs=True)
        if self.gather_output:
            def gathered(_l, inputs, out):
                plain = _passed_through(out)
                return _relayout(out if plain is None else plain, dim, Replicate())

            layer.register_forward_post_hook(gathered)
        else:
            layer.register_forward_post_hook(lambda _l, inputs, out: _passed_through(out))


def _passed_through(out):
    """The layer's output with any gathered input it returns unchanged (PaddleFormers' LM head under
    ``use_fused_head_and_loss_fn`` returns its hidden states for the fused loss) made an ordinary replicated
    tensor: the gathered input keeps its gradient partial on the TP dim for the layer's own split matmul, but a
    reader after the layer (a user PyLayer, which runs outside dispatch) gives a complete gradient on every rank,
    which the gather's reduce_scatter would sum once per TP rank. None when nothing passes through."""
    from autoparallel.comm.fanout import partial_dims, shared

    def plain(x):
        if not isinstance(x, DistTensor) or not partial_dims(x):
            return x
        return DistTensor._own(shared(x, dict(x._locals), None, x.spec, (), x.mesh), x.spec)

    if isinstance(out, (tuple, list)):
        items = [plain(x) for x in out]
        if all(a is b for a, b in zip(items, out)):
            return None
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    new = plain(out)
    return new if new is not out else None


@dataclass(frozen=True)
class RowWiseParallel(_Style):
    """Input features split. Linear [in, out]: weight S(0), bias replicated ([out, in] weight: S(1)); input
    sharded on the feature dim; output replicated (one all_reduce) or, under sequence parallel, sharded on
    the sequence dim (reduce_scatter). ``is_input_parallel`` (paddle's first argument) says whether the input
    arrives feature-sharded (True) or replicated (False); both are honoured: the input is resharded to the
    feature shard whatever it is (a replicated input is sliced locally, no communication)."""
    is_input_parallel: bool = True
    sequence_parallel: bool = field(default=False, kw_only=True)
    seq_dim: int = field(default=1, kw_only=True)

    def check(self, name, layer):
        _check_leaf(self, name, layer)

    def placements(self, layer) -> dict:
        return {"weight": Shard(0) if _is_linear(layer) else Shard(1)}

    def apply(self, layer, mesh, dim):
        _shard_targets(self, layer, mesh, dim, column=False)

        def feature_shard(x):
            return _relayout(x, dim, Shard(x.ndim - 1)) if isinstance(x, DistTensor) else x

        def post(_l, inputs, out):
            target = Shard(self.seq_dim) if self.sequence_parallel else Replicate()
            return _relayout(out, dim, target)

        layer.register_forward_pre_hook(lambda _l, args, kwargs: _relayout_all(args, kwargs, feature_shard),
                                        with_kwargs=True)
        layer.register_forward_post_hook(post)


@dataclass(frozen=True)
class VocabParallelEmbedding(_Style):
    """Embedding [vocab, hidden]: weight S(0) on the vocab; masked local lookup gives a Partial output,
    reduced to replicated (or sequence-sharded under sequence parallel)."""
    sequence_parallel: bool = False
    seq_dim: int = 1

    def check(self, name, layer):
        _check_leaf(self, name, layer)
        if _is_linear(layer):
            raise PlanError(f"VocabParallelEmbedding shards an embedding table [vocab, hidden], but {name!r} is a "
                            f"Linear (weight [in, out]); use ColWiseParallel or RowWiseParallel on it")

    def placements(self, layer) -> dict:
        return {"weight": Shard(0)}

    def apply(self, layer, mesh, dim):
        _shard_param(layer, "weight", mesh, dim, Shard(0))

        def post(_l, inputs, out):
            target = Shard(self.seq_dim) if self.sequence_parallel else Replicate()
            return _relayout(out, dim, target)

        layer.register_forward_post_hook(post)


@dataclass(frozen=True)
class SequenceParallel(_Style):
    """Norm / dropout layers run on sequence shards: input and output sharded on the sequence dim."""
    seq_dim: int = 1

    def check(self, name, layer):
        _check_leaf(self, name, layer, need_weight=False)

    def placements(self, layer) -> dict:
        return {}

    def apply(self, layer, mesh, dim):
        layer.register_forward_pre_hook(
            lambda _l, args, kwargs: _relayout_all(args, kwargs, lambda x: _relayout(x, dim, Shard(self.seq_dim))),
            with_kwargs=True)


STYLES = (ColWiseParallel, RowWiseParallel, VocabParallelEmbedding, SequenceParallel)


def name_matches(name: str, pattern: str) -> bool:
    """``pattern`` matches the full dotted name or any dotted suffix of it."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def match_plan(model, plan: dict) -> list:
    """[(name, sublayer, style)] for every sublayer matched by a plan pattern; a pattern matching no layer,
    or matching a layer the style cannot shard, is a PlanError naming it."""
    if not isinstance(plan, dict):
        raise TypeError(f"a tensor-parallel plan is a dict from layer-name patterns to styles, got "
                        f"{type(plan).__name__}")
    named = [(n, l) for n, l in model.named_sublayers() if n]
    out = []
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            raise TypeError(f"tensor-parallel plan keys are layer-name patterns (str), got {pattern!r}")
        if not isinstance(style, STYLES):
            raise TypeError(f"plan[{pattern!r}] must be one of {[s.__name__ for s in STYLES]}, got {style!r}")
        hits = [(n, l) for n, l in named if name_matches(n, pattern)]
        if not hits:
            raise PlanError(f"tensor-parallel plan pattern {pattern!r} matches no layer of "
                            f"{type(model).__name__}; its leaf layers: {_leaf_summary(named)}{_near(pattern, named)}")
        for n, l in hits:
            style.check(n, l)
        out.extend((n, l, style) for n, l in hits)
    _check_one_style(out, plan)
    return out


def _check_one_style(matched: list, plan: dict) -> None:
    """Two patterns giving one layer different styles (``"fc1": ColWise``, ``"fc*": RowWise``) would keep one
    of them silently; refused naming both patterns."""
    first = {}
    for name, _, style in matched:
        if name in first and first[name] != style:
            other = [p for p, s in plan.items() if s == first[name] and name_matches(name, p)]
            this = [p for p, s in plan.items() if s == style and name_matches(name, p)]
            raise PlanError(f"tensor-parallel plan patterns {other[:1] + this[:1]} both match layer {name!r} with "
                            f"different styles ({first[name]} and {style}); give each layer one style (narrow one "
                            f"of the patterns)")
        first.setdefault(name, style)


def _leaf_summary(named, limit: int = 16) -> str:
    """Leaf layer names with layer indices folded (``model.layers.*.mlp.up_proj``), in model order."""
    import re

    seen = []
    for n, l in named:
        if not list(l.children()):
            folded = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", n)
            if folded not in seen:
                seen.append(folded)
    more = f", ... ({len(seen) - limit} more)" if len(seen) > limit else ""
    return ", ".join(seen[:limit]) + more if seen else "(none)"


def _near(pattern: str, named) -> str:
    """Leaf names close to the pattern's last part (a typo or another model family's naming)."""
    import difflib

    leaves = sorted({n.rsplit(".", 1)[-1] for n, l in named if not list(l.children())})
    close = difflib.get_close_matches(pattern.rsplit(".", 1)[-1], leaves, n=3, cutoff=0.5)
    return f"; layers ending in {', '.join(repr(c) for c in close)} exist" if close else ""


def apply_tp(model, mesh, plan: dict, tp_dim="model"):
    """Shard ``model``'s matched layers on mesh dim ``tp_dim`` according to ``plan``; every holder of a
    replaced (tied) parameter is repointed to the one replacement."""
    import paddle

    from autoparallel.mesh import ProcessMesh
    from autoparallel.parallel.ties import holders, repoint

    if not isinstance(model, paddle.nn.Layer):
        raise TypeError(f"apply_tp expects the model as a paddle.nn.Layer, got {type(model).__name__}")
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"apply_tp expects a ProcessMesh, got {type(mesh).__name__}")
    if not isinstance(plan, dict):
        raise TypeError(f"a tensor-parallel plan is a dict from layer-name patterns to styles, got "
                        f"{type(plan).__name__} {plan!r:.80}")
    dim = mesh.dim_index(tp_dim)
    matched = match_plan(model, plan)
    before = holders(model)
    for _, layer, style in matched:
        style.apply(layer, mesh, dim)
    repoint(model, before)
    return model


def check_tp_degree(tp: int, heads: int = None, hidden: int = None, kv_heads: int = None) -> None:
    """TP must divide the attention heads (and kv heads) and the hidden size."""
    for name, n in (("heads", heads), ("kv_heads", kv_heads), ("hidden", hidden)):
        if n is not None and n % tp:
            raise ValueError(f"tensor-parallel degree {tp} must divide {name} ({n})")


__all__ = ["ColWiseParallel", "RowWiseParallel", "VocabParallelEmbedding", "SequenceParallel", "apply_tp",
           "match_plan", "name_matches", "check_tp_degree", "PlanError", "Partial"]
