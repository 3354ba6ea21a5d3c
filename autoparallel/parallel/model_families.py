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


# ---- a model config's own parallel flags (PaddleFormers 1.2 names, then the earlier PaddleNLP names) ----------
# Flags the model acts on while it is built: tensor_model_parallel_size > 1 builds paddle.distributed.fleet's
# mpu layers (local shards, fleet's collectives); sequence_parallel scatters activations with fleet's ops.
_BUILT_SPLIT = ("tensor_model_parallel_size", "sequence_parallel")
# Degrees the model only records (PaddleFormers' Trainer reads them): honoured when they equal the strategy's
_DECLARED = {"tensor_parallel_degree": ("tp", "strategy.tensor_parallel.degree"),
             "pipeline_model_parallel_size": ("pp", "strategy.pipeline_parallel.degree"),
             "pipeline_parallel_degree": ("pp", "strategy.pipeline_parallel.degree"),
             "virtual_pipeline_model_parallel_size": ("vpp", "strategy.pipeline_parallel.vpp_degree"),
             "virtual_pp_degree": ("vpp", "strategy.pipeline_parallel.vpp_degree")}
# Axes the library has no counterpart for
_NO_AXIS = {"expert_model_parallel_size": "expert", "expert_parallel_degree": "expert",
            "context_parallel_size": "context", "context_parallel_degree": "context",
            "sep_parallel_size": "sequence (sep)", "sep_parallel_degree": "sequence (sep)"}


def _degree(config, name: str) -> int:
    v = getattr(config, name, None)
    return v if isinstance(v, int) and not isinstance(v, bool) else 1


def _fleet_layers() -> tuple:
    from paddle.distributed.fleet.layers.mpu import mp_layers
    from paddle.distributed.fleet.meta_parallel import PipelineLayer
    from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

    return (mp_layers.ColumnParallelLinear, mp_layers.RowParallelLinear, mp_layers.VocabParallelEmbedding,
            mp_layers.ParallelCrossEntropy, spu.ColumnSequenceParallelLinear, spu.RowSequenceParallelLinear,
            PipelineLayer)


def check_built_split(model, where: str) -> None:
    """ValueError when the model split itself while it was built (fleet mpu / pipeline layers, or a config
    with tensor_model_parallel_size > 1 or sequence_parallel): the library would split it a second time."""
    fleet = _fleet_layers()
    for name, layer in model.named_sublayers(include_self=True):
        if isinstance(layer, fleet):
            raise ValueError(f"{where}: {name or 'the model'} is a paddle.distributed.fleet "
                             f"{type(layer).__name__}, built by the model itself (a config with "
                             f"tensor_model_parallel_size > 1, sequence_parallel or a ...Pipe model); {where} splits "
                             f"plain layers: build the model with tensor_model_parallel_size=1, sequence_parallel=False "
                             f"(and the non-Pipe class), then set strategy.tensor_parallel / sequence_parallel / "
                             f"pipeline_parallel")
    config = getattr(model, "config", None)
    for flag in _BUILT_SPLIT:
        v = getattr(config, flag, None)
        if (v is True) or (flag != "sequence_parallel" and _degree(config, flag) > 1):
            raise ValueError(f"{where}: model.config.{flag}={v!r} makes the model split itself with "
                             f"paddle.distributed.fleet; build it with tensor_model_parallel_size=1 and "
                             f"sequence_parallel=False: {where} splits it (strategy.tensor_parallel.degree, "
                             f"strategy.sequence_parallel.enable)")


def check_declared_degrees(model, strategy, degrees, where: str = "ap.parallelize") -> None:
    """The degrees a model config declares must be the strategy's: ValueError naming both otherwise;
    NotImplementedError for an expert / context / sep degree > 1 (no such axis here). The hybrid degrees of a
    ``fleet.init(strategy=...)`` made before are held to the same rule (autoparallel/fleet_guard.py).
    ``degrees`` None (``ap.to_static`` in auto_mode='full': the layout is not chosen yet): the axes only."""
    from autoparallel.fleet_guard import check_hybrid_degrees

    check_hybrid_degrees(strategy, degrees, where)
    config = getattr(model, "config", None)
    if config is None:
        return
    for flag, axis in _NO_AXIS.items():
        if _degree(config, flag) > 1:
            raise NotImplementedError(f"{where}: model.config.{flag}={_degree(config, flag)} asks for {axis} "
                                      f"parallelism, which {where} does not build; build the model with "
                                      f"{flag}=1 (the data / tensor / pipeline degrees come from the strategy)")
    if degrees is None:
        return
    ours = {"tp": degrees.tp, "pp": degrees.pp, "vpp": strategy.pipeline_parallel.vpp_degree}
    for flag, (axis, field) in _DECLARED.items():
        v = _degree(config, flag)
        if v > 1 and v != ours[axis]:
            raise ValueError(f"{where}: model.config.{flag}={v} but {field}={ours[axis]}; set {field}={v} "
                             f"or build the model with {flag}=1")
