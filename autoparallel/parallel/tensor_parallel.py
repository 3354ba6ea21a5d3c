"""Tensor-parallel plans: plain dicts from layer-name patterns to styles (torchtitan style).

    plan = {"blocks.*.attn.qkv": ColWiseParallel(), "blocks.*.attn.proj": RowWiseParallel(),
            "blocks.*.mlp.fc1": ColWiseParallel(), "blocks.*.mlp.fc2": RowWiseParallel(),
            "wte": VocabParallelEmbedding(), "blocks.*.ln*": SequenceParallel()}
    apply_tp(model, mesh, plan, tp_dim="model")

Each style shards its layer's parameters on the TP mesh dim and pins its input/output layouts with
forward hooks, so the collectives are exactly Megatron's: column-parallel takes a replicated input
(all_gather under sequence parallel) and gives a feature-sharded output; row-parallel takes the feature
shard and gives a replicated output (one all_reduce) or a sequence-sharded one (reduce_scatter).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from autoparallel.dist_tensor import DistTensor, is_dist, reshard, shard_tensor
from autoparallel.placement import Partial, Replicate, Shard


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


def _shard_param(layer, name, mesh, dim, p):
    param = getattr(layer, name, None)
    if param is None or is_dist(param):      # already laid out by the user: theirs wins
        return
    setattr(layer, name, shard_tensor(param, mesh, _with([Replicate()] * mesh.ndim, dim, p)))


@dataclass(frozen=True)
class ColWiseParallel:
    """Linear [in, out]: weight S(1), bias S(0); input replicated on the TP dim (all_gather if it was
    sequence-sharded); output sharded on the feature (last) dim."""
    sequence_parallel: bool = False

    def apply(self, layer, mesh, dim):
        _shard_param(layer, "weight", mesh, dim, Shard(1))
        _shard_param(layer, "bias", mesh, dim, Shard(0))
        layer.register_forward_pre_hook(lambda _l, inputs: tuple(_relayout(x, dim, Replicate()) for x in inputs))


@dataclass(frozen=True)
class RowWiseParallel:
    """Linear [in, out]: weight S(0), bias replicated; input sharded on the feature dim; output
    replicated (one all_reduce) or, under sequence parallel, sharded on the sequence dim (reduce_scatter)."""
    sequence_parallel: bool = False
    seq_dim: int = 1

    def apply(self, layer, mesh, dim):
        _shard_param(layer, "weight", mesh, dim, Shard(0))

        def pre(_l, inputs):
            return tuple(_relayout(x, dim, Shard(x.ndim - 1)) if isinstance(x, DistTensor) else x for x in inputs)

        def post(_l, inputs, out):
            target = Shard(self.seq_dim) if self.sequence_parallel else Replicate()
            return _relayout(out, dim, target)

        layer.register_forward_pre_hook(pre)
        layer.register_forward_post_hook(post)


@dataclass(frozen=True)
class VocabParallelEmbedding:
    """Embedding [vocab, hidden]: weight S(0) on the vocab; masked local lookup gives a Partial output,
    reduced to replicated (or sequence-sharded under sequence parallel)."""
    sequence_parallel: bool = False
    seq_dim: int = 1

    def apply(self, layer, mesh, dim):
        _shard_param(layer, "weight", mesh, dim, Shard(0))

        def post(_l, inputs, out):
            target = Shard(self.seq_dim) if self.sequence_parallel else Replicate()
            return _relayout(out, dim, target)

        layer.register_forward_post_hook(post)


@dataclass(frozen=True)
class SequenceParallel:
    """Norm / dropout layers run on sequence shards: input and output sharded on the sequence dim."""
    seq_dim: int = 1

    def apply(self, layer, mesh, dim):
        layer.register_forward_pre_hook(
            lambda _l, inputs: tuple(_relayout(x, dim, Shard(self.seq_dim)) for x in inputs))


STYLES = (ColWiseParallel, RowWiseParallel, VocabParallelEmbedding, SequenceParallel)


def match_plan(model, plan: dict) -> list:
    """[(name, sublayer, style)] for every sublayer matched by a plan pattern; a pattern matching no
    layer is an error listing what exists."""
    if not isinstance(plan, dict):
        raise TypeError(f"a tensor-parallel plan is a dict from layer-name patterns to styles, got {type(plan).__name__}")
    named = [(n, l) for n, l in model.named_sublayers() if n]
    out = []
    for pattern, style in plan.items():
        if not isinstance(style, STYLES):
            raise TypeError(f"plan[{pattern!r}] must be one of {[s.__name__ for s in STYLES]}, got {style!r}")
        hits = [(n, l) for n, l in named if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            sample = ", ".join(n for n, _ in named[:12])
            raise ValueError(f"tensor-parallel plan pattern {pattern!r} matches no layer of "
                             f"{type(model).__name__}; its layers include: {sample}")
        out.extend((n, l, style) for n, l in hits)
    return out


def apply_tp(model, mesh, plan: dict, tp_dim="model"):
    """Shard ``model``'s matched layers on mesh dim ``tp_dim`` according to ``plan``."""
    dim = mesh.dim_index(tp_dim)
    for _, layer, style in match_plan(model, plan):
        style.apply(layer, mesh, dim)
    return model


def check_tp_degree(tp: int, heads: int = None, hidden: int = None, kv_heads: int = None) -> None:
    """TP must divide the attention heads (and kv heads) and the hidden size."""
    for name, n in (("heads", heads), ("kv_heads", kv_heads), ("hidden", hidden)):
        if n is not None and n % tp:
            raise ValueError(f"tensor-parallel degree {tp} must divide {name} ({n})")


__all__ = ["ColWiseParallel", "RowWiseParallel", "VocabParallelEmbedding", "SequenceParallel", "apply_tp",
           "match_plan", "check_tp_degree", "Partial"]
