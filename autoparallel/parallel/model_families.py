"""What the library knows about model families: the default tensor-parallel plan a model gets by its layer names
(``parallel/tp_plans.py`` holds the plans), its size facts from ``model.config``, and the sequence-parallel
form of a plan. The orchestrator (``ap.parallelize``), the planner and the pipeline runtime all read it here."""
from __future__ import annotations

import dataclasses

from autoparallel.parallel.tensor_parallel import (RowWiseParallel, SequenceParallel, VocabParallelEmbedding,
                                                   match_plan, name_matches)
from autoparallel.parallel.tp_plans import FAMILIES, default_plan, family, no_family_error

# Default tensor-parallel plans by layer-name family (parallel/tp_plans.py).
DEFAULT_PLANS = FAMILIES


def model_info(model) -> dict:
    """Heads / kv_heads / hidden / layers / vocab from ``model.config`` when it has them (for validation).
    PaddleFormers / Hugging Face names count too, except their kv heads: fewer kv heads than TP ranks is
    handled by the default plan (k/v projections replicated, parallel/tp_plans.py), not refused."""
    c = getattr(model, "config", None)
    keys = {"heads": ("heads", "num_attention_heads"), "kv_heads": ("kv_heads",),
            "hidden": ("hidden", "hidden_size"), "layers": ("layers", "num_hidden_layers"), "vocab": ("vocab_size",)}
    out = {}
    for key, attrs in keys.items():
        for attr in attrs:
            v = getattr(c, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                out[key] = v
                break
    return out


def resolve_tp_plan(model, tp: int, user_plan: dict | None = None) -> dict:
    """{exact layer name: style}: the default plan for the layer names the model has (suffix patterns, any
    depth; parallel/tp_plans.py), overridden by the user's entries."""
    if tp == 1:
        return {}
    user = {name: style for name, _, style in match_plan(model, user_plan)} if user_plan is not None else {}
    resolved = default_plan(model, tp)
    if not resolved and not user:
        raise no_family_error(model, tp)
    resolved.update(user)
    return resolved


def apply_sp(model, plan: dict) -> dict:
    """Sequence parallel: row-parallel and vocab-parallel outputs become sequence shards (reduce_scatter
    instead of all_reduce) and every norm layer runs on sequence shards."""
    out = {}
    for name, style in plan.items():
        if isinstance(style, (RowWiseParallel, VocabParallelEmbedding)):
            style = dataclasses.replace(style, sequence_parallel=True)
        out[name] = style
    if not out:
        return out
    for name, layer in model.named_sublayers():
        if name and name not in out and type(layer).__name__.endswith("Norm"):
            out[name] = SequenceParallel()
    return out


def matches(model, pattern: str) -> bool:
    return any(name_matches(n, pattern) for n, _ in model.named_sublayers() if n)


def default_family(model):
    return family(model)
