"""``paddle.distributed.fleet`` next to this package: what runs, what is refused and why.

* ``fleet.init(is_collective=True, strategy=...)`` then ``ap.parallelize`` / ``ap.shard_layer`` runs (fleet only
  makes its process groups). Degrees the fleet strategy's ``hybrid_configs`` set must be the Strategy's:
  ``check_hybrid_degrees`` refuses a different one (fleet's config would otherwise be silently not what runs).
* ``fleet.distributed_model`` over a model with distributed parameters wraps it in ``paddle.DataParallel`` (dp),
  ``TensorParallel`` (mp: broadcasts rank 0's tensor-parallel parameters), ``ShardingParallel`` or a pipeline:
  each would split, broadcast or reduce again what this package already did. Refused by name.
* ``fleet.distributed_optimizer`` over such parameters returns fleet's ``HybridParallelOptimizer``, which
  all-reduces gradients over fleet's data group again and clips with fleet's own view of the shards (measured on
  2 gloo ranks with hybrid mp=2 and a tensor-parallel model: the second step's loss 1.4271 instead of 1.4249).
  Refused by name.
"""
from __future__ import annotations

import functools
import sys

from autoparallel import after_import, patches

TARGET = "paddle.distributed.fleet"


def _has_dist_params(model) -> bool:
    from autoparallel.dist_tensor import is_dist

    params = model.parameters() if hasattr(model, "parameters") and callable(model.parameters) else ()
    return any(is_dist(p) for p in params)


def _optimizer_params(opt, depth: int = 4) -> list:
    """Parameters an optimizer (or one of this package's wrappers around it) holds."""
    for _ in range(depth):
        params = getattr(opt, "_parameter_list", None)
        if params:
            return [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
        opt = next((getattr(opt, a) for a in ("_inner_opt", "inner", "_opt", "optimizer") if hasattr(opt, a)), None)
        if opt is None:
            break
    return []


def _is_ours(opt) -> bool:
    from autoparallel.dist_tensor import is_dist

    return type(opt).__module__.startswith("autoparallel") or any(is_dist(p) for p in _optimizer_params(opt))


def _model_guard(orig):
    @functools.wraps(orig)
    def distributed_model(model, *args, **kwargs):
        if _has_dist_params(model):
            raise NotImplementedError(
                f"fleet.distributed_model over {type(model).__name__}, whose parameters are distributed by "
                f"autoparallel: fleet would wrap it in paddle.DataParallel / TensorParallel / ShardingParallel, "
                f"which broadcast rank 0's parameters over shards and reduce gradients again. Use the model "
                f"ap.parallelize / ap.shard_layer returned as it is")
        return orig(model, *args, **kwargs)

    return distributed_model


def _optimizer_guard(orig):
    @functools.wraps(orig)
    def distributed_optimizer(optimizer, *args, **kwargs):
        if _is_ours(optimizer):
            raise NotImplementedError(
                f"fleet.distributed_optimizer over {type(optimizer).__name__}, an optimizer of parameters "
                f"distributed by autoparallel: fleet's HybridParallelOptimizer would all-reduce their gradients "
                f"again and clip with its own view of the shards. Use the optimizer ap.parallelize / "
                f"ap.shard_optimizer returned as it is (set grad_clip on the paddle optimizer you pass in)")
        return orig(optimizer, *args, **kwargs)

    return distributed_optimizer


def install() -> None:
    if TARGET not in sys.modules:
        after_import.watch(TARGET, install)
        return
    fleet = sys.modules[TARGET]
    for name, guard in (("distributed_model", _model_guard), ("distributed_optimizer", _optimizer_guard)):
        orig = getattr(fleet, name, None)
        if orig is None or orig in _OURS:
            continue
        g = guard(orig)
        _OURS.add(g)
        patches.patch(fleet, name, g)


_OURS: set = set()


# ---- fleet's hybrid degrees against the Strategy -----------------------------------------------------------
_FIELDS = {"dp_degree": "strategy.data_parallel.degree", "mp_degree": "strategy.tensor_parallel.degree",
           "pp_degree": "strategy.pipeline_parallel.degree", "sharding_degree": "strategy.sharding.enable / .degree"}


def hybrid_degrees() -> dict:
    """{name: degree} the user gave fleet.init's strategy.hybrid_configs, where above 1 ({} when fleet was not
    initialised). dp_degree -1 (fleet's default: the rest of the world) and degrees of 1 ask for nothing."""
    fleet = sys.modules.get(TARGET)
    env = getattr(fleet, "fleet", None) if fleet is not None else None
    if env is None or getattr(env, "_hcg", None) is None:
        return {}
    configs = getattr(getattr(env, "_user_defined_strategy", None), "hybrid_configs", None)
    out = {}
    for name in tuple(_FIELDS) + ("sep_degree", "cp_degree", "ep_degree"):
        try:
            v = configs[name]
        except (KeyError, TypeError, AttributeError):
            continue
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            out[name] = v
    return out


def check_hybrid_degrees(strategy, degrees, where: str = "ap.parallelize") -> None:
    """After ``fleet.init(strategy=...)``: each hybrid degree the user set above 1 must be the Strategy's
    (ValueError naming both); a sep / cp / ep degree > 1 is NotImplementedError (no such axis here).
    ``degrees`` None (the planner has not chosen them yet): the axes only."""
    fleet_deg = hybrid_degrees()
    for name in ("sep_degree", "cp_degree", "ep_degree"):
        if name in fleet_deg:
            raise NotImplementedError(f"{where}: fleet.init's hybrid_configs {name}={fleet_deg[name]} asks "
                                      f"for an axis {where} does not build; init fleet with {name}=1")
    if degrees is None:
        return
    sharding = (strategy.sharding.degree or degrees.dp) if strategy.sharding.enable else 1
    ours = {"dp_degree": degrees.dp, "mp_degree": degrees.tp, "pp_degree": degrees.pp, "sharding_degree": sharding}
    if "sharding_degree" in fleet_deg:                   # fleet splits the data ranks into dp x sharding
        ours["dp_degree"] = degrees.dp // max(sharding, 1)
    for name, field in _FIELDS.items():
        if name in fleet_deg and fleet_deg[name] != ours[name]:
            raise ValueError(f"{where}: fleet.init's hybrid_configs {name}={fleet_deg[name]} but "
                             f"{field} gives {ours[name]}; the Strategy decides the layout here: set {field} to "
                             f"match, or init fleet without hybrid_configs")
