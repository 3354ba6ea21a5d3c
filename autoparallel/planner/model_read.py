"""What ``auto_mode="full"`` reads off the user's model, and from where.

    spec = read_model(model, seq_len)      # ModelSpec; spec.source says what was traced / read / estimated

1. The forward is traced (``ModelSpec.from_trace``): op counts, FLOPs and activation bytes per block; the
   dimensions from the parameters, heads from ``model.config``.
2. A forward the spec-only trace cannot follow -- a mixture of experts routes tokens with value-dependent
   shapes (``where`` / ``nonzero`` on the router's choice) -- is read from its config instead
   (``from_config``): hidden, layers, heads, kv heads, vocabulary, FFN width, experts, top-k, the experts'
   width and shared experts, with the MoE blocks counted on the model's layers (blocks holding ``experts``), and
   multi-head latent attention's ranks and head widths (``MLA_CONFIG``) when the config sets ``kv_lora_rank``.
   Its per-token cost is then *estimated*: tokens spread evenly over the experts (each visits ``top_k``),
   priced by the planner's MoE formulas. The eager op counts are still traced: spec-only outside the MoE
   layers, which run eagerly on a random sample (planner/moe_trace.py; the template for a LazyGuard model).
   A model that is not a mixture of experts and still cannot be traced is refused (the error names the op).
3. Both ways, the real parameter count is kept: what the closed form misses goes to ``extra_layer_params``.

``allowed_tp(model, world)`` lists the tensor-parallel degrees the model's own default plan can take.
"""
from __future__ import annotations

import math

from autoparallel.planner.latent_attention import MLA_CONFIG, mla_fields  # noqa: F401  (mla_fields re-exported)

CONFIG = {   # ModelSpec field -> config attribute names (PaddleFormers / Hugging Face first, then the project's)
    "hidden": ("hidden_size", "hidden"), "layers": ("num_hidden_layers", "layers", "n_layer"),
    "heads": ("num_attention_heads", "heads", "n_head"), "kv_heads": ("num_key_value_heads", "kv_heads"),
    "vocab": ("vocab_size", "vocab"), "ffn": ("intermediate_size", "ffn"),
    "experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    "top_k": ("num_experts_per_tok", "moe_k", "top_k"),
    "expert_ffn": ("moe_intermediate_size",),
}


def config_value(model, key):
    """(value, attribute name) of the first positive int among ``CONFIG[key]`` in ``model.config``."""
    c = getattr(model, "config", None)
    for attr in CONFIG[key]:
        v = getattr(c, attr, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v, attr
    return None, None


def read_model(model, seq_len: int, name: str):
    """The ModelSpec of ``model`` (see the module docstring)."""
    from spmd_rules.errors import DataDependentShapeError

    from autoparallel.planner.model_spec import ModelSpec

    try:
        return with_trainable(ModelSpec.from_trace(model, seq_len, 1, name=name), model)
    except DataDependentShapeError as e:
        op = str(e).split(":", 1)[0]
        if config_value(model, "experts")[0] is None:
            raise ValueError(f"auto_mode='full': the trace of {type(model).__name__} stops at {op!r}, whose output "
                             f"size depends on the values, and model.config names no experts (one of "
                             f"{', '.join(CONFIG['experts'])}) to price that part from; choose the degrees "
                             f"yourself (auto_mode='semi')") from e
        return with_trainable(with_moe_ops(from_config(model, seq_len, name, op), model, seq_len), model)


def trainable_fraction(model) -> tuple:
    """(trainable, total) parameter elements of ``model``, from ``stop_gradient`` (a LoRA model: the adapters)."""
    import math

    from autoparallel.dist_tensor import DistParameter

    sizes = [(math.prod(p.spec.shape if isinstance(p, DistParameter) else p.shape), p.stop_gradient)
             for p in model.parameters()]
    return sum(n for n, frozen in sizes if not frozen), sum(n for n, _ in sizes)


def with_trainable(spec, model):
    """``spec`` with the model's trainable share: gradients, their sync and optimizer states count only those."""
    from dataclasses import replace

    train, total = trainable_fraction(model)
    if total == 0 or train == total:
        return spec
    return replace(spec, trainable_fraction=train / total,
                   source=spec.source + f"; trainable: {train:,} of {total:,} parameters (stop_gradient)")


def with_moe_ops(spec, model, seq_len: int):
    """``spec`` with the eager op counts of a trace whose MoE layers run eagerly (planner/moe_trace.py); a
    model built under paddle.LazyGuard keeps the template counts (its experts cannot run)."""
    from dataclasses import replace

    from autoparallel.planner.moe_trace import LazyModel, trace_moe

    try:
        ops, _, _, counts = trace_moe(model, seq_len)
    except LazyModel as e:
        return replace(spec, source=spec.source + f"; op counts: the template ({e})")
    moe = sorted(set(counts.values()))
    source = spec.source.replace(" and the eager op counts (template)", "")
    return replace(spec, ops=ops, source=source + f"; traced: the eager op counts, spec-only outside the MoE "
                                                  f"layers, which ran eagerly on a random sample ({moe} ops each)")


def _moe_blocks(blocks) -> int:
    return sum(any(n.rsplit(".", 1)[-1] == "experts" for n, _ in b.named_sublayers()) for b in blocks)


def _shared_experts(model, expert_ffn: int):
    """(shared experts counted in units of ``expert_ffn``, how it was read)."""
    c = model.config
    n = getattr(c, "n_shared_experts", None)
    if isinstance(n, int) and n > 0:
        return n, f"n_shared_experts={n}"
    width = getattr(c, "shared_expert_intermediate_size", None)
    if isinstance(width, int) and width > 0:
        return math.ceil(width / expert_ffn), f"shared_expert_intermediate_size={width}"
    return 0, "no shared expert"


def _gated(model) -> bool:
    names = [n for n, _ in model.named_parameters()]
    return any(k in n for n in names for k in ("gate_proj", "up_gate", "gate_up", "w3"))


def from_config(model, seq_len: int, name: str, stopped_at: str):
    """A ModelSpec of a mixture of experts from its config and layers (see the module docstring)."""
    from autoparallel.planner.from_trace import (_find_blocks, _norms, config_attn_dim, fit_attention_width, head_tied,
                                                 with_residual)
    from autoparallel.planner.model_spec import ModelSpec

    values, used = {}, []
    for key in ("hidden", "layers", "heads", "kv_heads", "vocab", "ffn", "experts", "top_k", "expert_ffn"):
        v, attr = config_value(model, key)
        if v is not None:
            values[key] = v
            used.append(f"{attr}={v}")
    if "expert_ffn" not in values and "ffn" in values:
        values["expert_ffn"] = values["ffn"]          # GPT-OSS: the experts have the dense width
    missing = [k for k in ("hidden", "layers", "heads", "vocab", "experts", "top_k", "expert_ffn") if k not in values]
    if missing:
        raise ValueError(f"auto_mode='full': {type(model).__name__}'s forward cannot be traced (it stops at "
                         f"{stopped_at!r}) and model.config lacks {', '.join(missing)} (expected one of "
                         f"{'; '.join(', '.join(CONFIG[k]) for k in missing)}) to price it from; choose the "
                         f"degrees yourself (auto_mode='semi')")
    _, blocks = _find_blocks(model)
    if len(blocks) != values["layers"]:
        raise ValueError(f"auto_mode='full': model.config says {values['layers']} layers but {type(model).__name__} "
                         f"has {len(blocks)} blocks in its LayerList")
    moe = _moe_blocks(blocks)
    if moe == 0:
        raise ValueError(f"auto_mode='full': model.config of {type(model).__name__} names experts but no block "
                         f"holds an 'experts' sublayer, and the trace stops at {stopped_at!r}")
    shared, shared_how = _shared_experts(model, values["expert_ffn"])
    c = model.config
    mla = mla_fields(model, values["heads"])
    if mla:
        values["kv_heads"] = mla.pop("kv_heads")        # MLA projects keys and values up per query head
        used.append(", ".join(f"{k}={getattr(c, k)}" for k in MLA_CONFIG))
    spec = ModelSpec(name, hidden=values["hidden"], layers=values["layers"], heads=values["heads"],
                     vocab=values["vocab"], ffn=values.get("ffn", 0), kv_heads=values.get("kv_heads", 0), **mla,
                     seq_len=int(seq_len), swiglu=_gated(model), bias=False,
                     layernorm=any(getattr(n, "bias", None) is not None for _, n in _norms(blocks[0])),
                     tied_embeddings=head_tied(model, blocks, values["hidden"], values["vocab"]),
                     learned_positions=False,
                     dropout=bool(getattr(c, "attention_dropout", 0.0) or getattr(c, "hidden_dropout", 0.0) or 0.0),
                     experts=values["experts"], top_k=values["top_k"], expert_ffn=values["expert_ffn"],
                     shared_experts=shared, dense_layers=len(blocks) - moe,
                     attn_dim=config_attn_dim(model, values["hidden"], values["heads"]))
    source = (f"read from model.config (the trace stops at {stopped_at!r}, a value-dependent shape in the "
              f"experts' routing): {', '.join(used)}, {shared_how}; from the layers: {moe} of {len(blocks)} "
              f"blocks hold experts; estimated: the per-token cost of the MoE blocks (tokens spread evenly, "
              f"top_{values['top_k']} of {values['experts']} experts each) and the eager op counts (template)")
    return with_residual(fit_attention_width(spec, model), model, source)


# ---- degrees the model's plans can take -----------------------------------------------------------------
def tp_refusal(model, tp: int, own_plan: bool = False):
    """Why the model's default tensor-parallel plan cannot run at degree ``tp``, or None. The plans split
    whole attention heads (q / o, MLA's per-head up-projections), so ``tp`` must divide the heads and hidden
    (``Strategy.validate``'s rule); no family plan matching the layer names means no plan at all. What the
    plans adapt themselves is no limit: fewer kv heads than ``tp`` (k / v replicated), fused blocks that do not
    divide (gathered), uneven vocabulary or MLP widths (ceil-division shards), experts (replicated: the runtime
    has no expert parallelism). ``own_plan``: the user passes a tp_plan, so no default plan is needed."""
    from autoparallel.parallel.model_families import model_info
    from autoparallel.parallel.tp_plans import default_plan

    if tp == 1:
        return None
    info = model_info(model)
    for key in ("heads", "hidden"):
        if key in info and info[key] % tp:
            return f"{key}={info[key]} is not divisible by tp={tp} (the plans split whole heads)"
    if not own_plan and not default_plan(model, tp):
        return f"no default tensor-parallel plan matches the layer names of {type(model).__name__}"
    return None


def allowed_tp(model, world: int, own_plan: bool = False):
    """({tp: None or why refused}) for every divisor of ``world`` (``own_plan``: the user's tp_plan applies)."""
    from autoparallel.planner.search import divisors

    return {tp: tp_refusal(model, tp, own_plan) for tp in divisors(world)}
