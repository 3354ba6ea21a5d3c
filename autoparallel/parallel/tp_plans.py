"""Default tensor-parallel plans by layer-name family (Megatron layout), found anywhere in the model tree.

Patterns are dotted-name suffixes (``self_attn.q_proj`` matches ``model.layers.0.self_attn.q_proj``; see
``tensor_parallel.name_matches``). ``default_plan(model, tp)`` gives ``{exact layer name: style}`` from every
family at once (a layer takes the first family pattern it matches), then adapts it to the model's config:

* fused projections: ``qkv_proj`` whose output the model reshapes per kv head
  (``[.., kv_heads, (groups + 2) * head_dim]``: Qwen2/3, ERNIE 4.5, Gemma3) is split on its output columns, so
  with ``kv_heads % tp == 0`` every device keeps whole kv groups (their query heads, key and value) and the
  model's own reshape/split stays local. Projections the model cuts in blocks (``up_gate_proj`` /
  ``gate_up_proj`` chunked into [gate | up]; Phi3's ``qkv_proj`` sliced [q | k | v]) are
  ``FusedColWiseParallel``: the weight is block-sharded (``S(1,blocks=(I, I))``, ``S(1,blocks=(q, k, v))``),
  so each device keeps matching gate and up halves (whole q, k and v heads) and the model's chunk/slice is
  local: no collective beyond Megatron's. A block that does not divide by ``tp`` (an odd intermediate size;
  kv heads < tp), or a weight created under ``paddle.LazyGuard``, falls back to column-parallel with the
  output gathered (one all_gather per layer).
* grouped-query attention with ``num_key_value_heads % tp != 0`` (e.g. fewer kv heads than TP ranks):
  ``k_proj``/``v_proj`` stay replicated (every device computes all kv heads; queries stay split), a fused
  ``qkv_proj`` is column-parallel with its output gathered (the kv blocks cannot be split by tp).
* MoE experts (``*.experts.*``) are left replicated; the dense layers around them (shared experts too) are
  sharded.
* multi-head latent attention (DeepSeek-V3): the low-rank down-projections (``q_a_proj``,
  ``kv_a_proj_with_mqa``, whose output also carries the rope key shared by all heads) stay replicated; the
  per-head up-projections ``q_b_proj``/``kv_b_proj`` (or ``q_proj`` without a q rank) are split by heads and
  ``o_proj`` is row-parallel, so the model's per-head reshape and split stay local.
* blocks no name pattern matches (an encoder-decoder's ``fc1``/``fc2`` and cross attention, vision towers'
  ``qkv``/``proj``/``linear_fc1``...) are recognised by structure (``tp_structure.py``: the Linears' shapes
  and what else the layer holds), names serving only as hints.
* a ``[vocab, hidden]`` head (PaddleFormers' ``LMHead``) under ColWiseParallel is split on the vocabulary, the
  same layout as the vocab-parallel embedding, so a tied embedding/head pair stays one parameter.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autoparallel.parallel.tensor_parallel import (ColWiseParallel, PlanError, RowWiseParallel,
                                                   VocabParallelEmbedding, _is_linear, _weight_2d, name_matches)
from autoparallel.parallel.tp_adapters import base_linear, is_adapter_wrapper
from autoparallel.placement import BlockShard


@dataclass(frozen=True)
class FusedColWiseParallel(ColWiseParallel):
    """Column-parallel for a fused projection whose output the model cuts into blocks. ``parts``: the blocks'
    relative sizes along the output features ((1, 1) for [gate | up]; (q heads, kv heads, kv heads) for
    [q | k | v]). Weight ``S(1,blocks=..)`` (``S(0,..)`` for an [out, in] weight), bias ``S(0,blocks=..)``:
    every device keeps its piece of each block, so the model's chunk/slice of the output is local."""
    parts: tuple = (1, 1)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.parts, tuple) or not self.parts or \
                not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in self.parts):
            raise TypeError(f"FusedColWiseParallel(parts=...) expects a tuple of positive ints (relative block "
                            f"sizes), got {self.parts!r}")

    def blocks(self, layer) -> tuple:
        w = _weight_2d(layer)
        out = int(w.shape[1] if _is_linear(layer) else w.shape[0])
        if out % sum(self.parts):
            raise PlanError(f"FusedColWiseParallel(parts={self.parts}): {out} output features do not divide into "
                            f"blocks of relative sizes {self.parts}")
        unit = out // sum(self.parts)
        return tuple(v * unit for v in self.parts)

    def placements(self, layer) -> dict:
        b = self.blocks(layer)
        return {"weight": BlockShard(1 if _is_linear(layer) else 0, b), "bias": BlockShard(0, b)}


COL, ROW, VOCAB = ColWiseParallel(), RowWiseParallel(), VocabParallelEmbedding()
GATHER = ColWiseParallel(gather_output=True)      # fallback for fused blocks tp does not divide
GATE_UP = FusedColWiseParallel(parts=(1, 1))      # [gate | up] chunked in two

GPT_PLAN = {   # the project's GPT (examples/models) and GPT-2 style names
    "wte": VOCAB,
    "blocks.*.attn.qkv": COL, "blocks.*.attn.proj": ROW, "blocks.*.mlp.fc1": COL, "blocks.*.mlp.fc2": ROW,
    "attn.c_attn": GATHER, "attn.c_proj": ROW, "mlp.c_fc": COL, "mlp.c_proj": ROW,
    "lm_head": COL,
}
LLAMA_PLAN = {
    "embed_tokens": VOCAB,
    "self_attn.q_proj": COL, "self_attn.k_proj": COL, "self_attn.v_proj": COL, "self_attn.o_proj": ROW,
    "mlp.gate_proj": COL, "mlp.up_proj": COL, "mlp.down_proj": ROW,
    "shared_experts.gate_proj": COL, "shared_experts.up_proj": COL, "shared_experts.down_proj": ROW,
    "lm_head": COL,
}
MLA_PLAN = {  # multi-head latent attention (DeepSeek-V2/V3): the per-head up-projections split by heads
    "self_attn.q_b_proj": COL, "self_attn.kv_b_proj": COL, "self_attn.o_proj": ROW,
}
FUSED_PLAN = {  # Qwen2 / Qwen3 / ERNIE 4.5 / Gemma3 / Phi3 (PaddleFormers) fused projections
    "embed_tokens": VOCAB,
    "self_attn.qkv_proj": COL, "self_attn.o_proj": ROW,
    "mlp.up_gate_proj": GATE_UP, "mlp.gate_up_proj": GATE_UP, "mlp.down_proj": ROW,
    "shared_expert.up_gate_proj": GATE_UP, "shared_expert.gate_up_proj": GATE_UP, "shared_expert.down_proj": ROW,
    "shared_experts.up_gate_proj": GATE_UP, "shared_experts.gate_up_proj": GATE_UP,
    "shared_experts.down_proj": ROW,
    "lm_head": COL,
}
ERNIE_PLAN = {  # ERNIE 1-3 / paddle.nn.TransformerEncoderLayer names
    "word_embeddings": VOCAB,
    "self_attn.q_proj": COL, "self_attn.k_proj": COL, "self_attn.v_proj": COL, "self_attn.out_proj": ROW,
    "linear1": COL, "linear2": ROW,
}
FAMILIES = {"GPT": GPT_PLAN, "LLaMA": LLAMA_PLAN, "MLA": MLA_PLAN, "fused-projection": FUSED_PLAN,
            "ERNIE": ERNIE_PLAN}
EXCLUDE = ("experts.*",)                      # MoE experts stay replicated (expert parallelism: out of scope)
BLOCK_QKV_MODELS = ("phi3",)                  # config.model_type whose qkv_proj output is sliced [q | k | v]


def _leaves(model):
    """Leaf layers, a LoRA wrapper counting as the leaf in place of the Linear it adapts (tp_adapters.py)."""
    named = [(n, l) for n, l in model.named_sublayers() if n]
    wrapped = {n for n, l in named if is_adapter_wrapper(l)}
    return [(n, l) for n, l in named
            if n in wrapped or (not list(l.children()) and n.rpartition(".")[0] not in wrapped)]


def _excluded(name: str) -> bool:
    return any(name_matches(name, "*." + e) or name_matches(name, e) for e in EXCLUDE)


def raw_plan(model) -> dict:
    """{exact layer name: style} of every leaf layer some family pattern matches (first family wins)."""
    out = {}
    for name, _ in _leaves(model):
        if _excluded(name):
            continue
        for plan in FAMILIES.values():
            style = next((s for p, s in plan.items() if name_matches(name, p)), None)
            if style is not None:
                out[name] = style
                break
    return out


def _config(model, *names):
    c = getattr(model, "config", None)
    for n in names:
        v = getattr(c, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def default_plan(model, tp: int) -> dict:
    """The default plan for ``model`` at TP degree ``tp``, adapted to its config (see module docstring)."""
    plan = raw_plan(model)
    kv = _config(model, "num_key_value_heads", "kv_heads")
    heads = _config(model, "num_attention_heads", "n_head", "num_heads")
    split_kv = kv is None or kv % tp == 0
    blocked_qkv = getattr(getattr(model, "config", None), "model_type", None) in BLOCK_QKV_MODELS
    layers = dict(model.named_sublayers())
    for name, style in list(plan.items()):
        if name_matches(name, "k_proj") or name_matches(name, "v_proj"):
            if not split_kv:
                del plan[name]                   # kv heads replicated
        elif name_matches(name, "qkv_proj") and blocked_qkv and split_kv and heads and heads % tp == 0:
            plan[name] = _fused_or_gather(FusedColWiseParallel(parts=(heads, kv or heads, kv or heads)),
                                          base_linear(layers[name]) or layers[name], tp)
        elif name_matches(name, "qkv_proj") and (blocked_qkv or not split_kv):
            plan[name] = dataclasses.replace(style, gather_output=True)
        elif isinstance(style, FusedColWiseParallel):
            plan[name] = _fused_or_gather(style, base_linear(layers[name]) or layers[name], tp)
    return with_structural(plan, model, tp)


def with_structural(plan: dict, model, tp: int) -> dict:
    """``plan`` plus the blocks recognised by structure (tp_structure.py) none of whose Linears a name
    pattern already styles."""
    from autoparallel.parallel.tp_structure import structural_blocks

    for names in structural_blocks(model, tp, EXCLUDE):
        if not any(n in plan for n in names):
            plan.update(names)
    return plan


def _fused_or_gather(style, layer, tp: int):
    """``style`` when every block divides by ``tp``; else column-parallel with the output gathered (also for
    a weight created under paddle.LazyGuard: lazy initialisation fills one box per rank, which a block-sharded
    local is not)."""
    from autoparallel.lazy_init.params import is_lazy

    try:
        blocks = style.blocks(layer)
    except (PlanError, AttributeError, TypeError):
        return GATHER
    if is_lazy(_weight_2d(layer)):
        return GATHER
    return style if all(b % tp == 0 for b in blocks) else GATHER


def family(model):
    """The family with the most patterns found in ``model`` (None when nothing matches)."""
    leaves = [n for n, _ in _leaves(model)]
    best, hits = None, 0
    for fam, plan in FAMILIES.items():
        k = sum(any(name_matches(n, p) for n in leaves) for p in plan)
        if k > hits:
            best, hits = fam, k
    return best


def no_family_error(model, tp: int) -> PlanError:
    names = [n for n, _ in model.named_sublayers() if n]
    expected = "; ".join(f"{k}-style names like {', '.join(list(p)[:4])}" for k, p in FAMILIES.items())
    return PlanError(f"tensor_parallel.degree={tp} but no layer of {type(model).__name__} matches a default "
                     f"tensor-parallel plan: expected {expected}; got layers "
                     f"{', '.join(names[:12]) or '(none)'}, and no block of Linears found by structure (an [a, f] -> "
                     f"[f, c] pair, q / k / v / out attention: tp_structure.py); pass tp_plan={{pattern: style}} "
                     f"to parallelize")


__all__ = ["FusedColWiseParallel", "FAMILIES", "GPT_PLAN", "LLAMA_PLAN", "MLA_PLAN", "FUSED_PLAN", "ERNIE_PLAN", "default_plan", "raw_plan", "family",
           "no_family_error"]
