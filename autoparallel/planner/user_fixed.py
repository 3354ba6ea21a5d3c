"""What a user fixed next to ``auto_mode="full"``: kept as a constraint of the search, or refused by name.

    fixed = fixed_constraints(strategy, mesh)     # {"dp": (2,), "sharding": (3,), ...}
    spaces = [narrowed(c, fixed) for c in spaces]  # None: this search cannot honour them

Kept (the search picks only among configurations with that value): ``data_parallel.degree``,
``tensor_parallel.degree``, ``pipeline_parallel.degree``, ``sequence_parallel.enable``, ``sharding.enable`` with
its ``stage``, ``recompute.enable`` with its ``granularity``, and the degrees of a ``mesh`` passed to
``ap.parallelize`` (its dim sizes). ``gradient_accumulation_steps`` is kept as the loop's shape
(``generic.keep_accumulation``). Every other field the planner chooses (micro-batch sizes, schedules, split
points, ZeRO degree and offload, recompute spacing) is refused with its name and value.
"""
from __future__ import annotations

from autoparallel.config.validation import _PLANNER_FIELDS, _PLANNER_KEPT as KEPT
NAMES = {"dp": "data_parallel.degree", "tp": "tensor_parallel.degree", "pp": "pipeline_parallel.degree",
         "sp": "sequence_parallel.enable", "sharding": "sharding.stage", "recompute": "recompute.granularity"}


def _field(strategy, name):
    section, _, leaf = name.partition(".")
    value = getattr(strategy, section)
    return getattr(value, leaf) if leaf else value


def refused_fields(strategy) -> list:
    """``name=value`` of the planner's fields the user set that no search constraint keeps."""
    from autoparallel.strategy import Strategy

    fresh, bad = Strategy(), []
    for name in _PLANNER_FIELDS:
        mine = _field(strategy, name)
        if name not in KEPT and mine != _field(fresh, name):
            bad.append(f"{name}={mine!r}")
    for section, leaf in (("sharding", "stage"), ("recompute", "granularity")):
        cfg = getattr(strategy, section)
        if not cfg.enable and getattr(cfg, leaf) != getattr(getattr(fresh, section), leaf):
            bad.append(f"{section}.{leaf}={getattr(cfg, leaf)!r} without {section}.enable=True")
    return bad


def fixed_constraints(strategy, mesh=None, world: int = None) -> dict:
    """{search knob: (allowed value,)} for what the user fixed (see the module docstring); ValueError naming
    every field the search cannot keep, or a mesh disagreeing with the strategy's degrees."""
    bad = refused_fields(strategy)
    if bad:
        raise ValueError(f"auto_mode='full' chooses {', '.join(bad)} itself; expected the default (the planner "
                         f"picks it), or auto_mode='semi' to set it yourself")
    fixed = {}
    if strategy.data_parallel.degree is not None:
        fixed["dp"] = (strategy.data_parallel.degree,)
    for knob, value in (("tp", strategy.tensor_parallel.degree), ("pp", strategy.pipeline_parallel.degree)):
        if value != 1:
            fixed[knob] = (value,)
    if strategy.sequence_parallel.enable:
        fixed["sp"] = (1,)
    if strategy.sharding.enable:
        fixed["sharding"] = (strategy.sharding.stage,)
    if strategy.recompute.enable:
        fixed["recompute"] = (strategy.recompute.granularity,)
    return _with_mesh(fixed, mesh, world)


def _with_mesh(fixed: dict, mesh, world) -> dict:
    """The mesh's dim sizes are the degrees dp, tp, pp; it spans the whole world."""
    if mesh is None:
        return fixed
    import math

    from autoparallel.api_parallelize import mesh_degrees
    from autoparallel.core.mesh import as_mesh

    mesh = as_mesh(mesh)
    degrees = mesh_degrees(mesh)
    if world is not None and math.prod(mesh.shape) != world:
        raise ValueError(f"auto_mode='full': the mesh {list(mesh.dim_names)} {list(mesh.shape)} spans "
                         f"{math.prod(mesh.shape)} ranks, expected all {world} ranks of the world")
    out = dict(fixed)
    for knob, axis in (("dp", "data"), ("tp", "model"), ("pp", "pipe")):
        if knob in fixed and fixed[knob] != (degrees[axis],):
            raise ValueError(f"auto_mode='full': the mesh {list(mesh.dim_names)} {list(mesh.shape)} gives "
                             f"{NAMES[knob]}={degrees[axis]}, but the strategy sets {NAMES[knob]}={fixed[knob][0]}; "
                             f"expected them to agree (or one of them left unset)")
        out[knob] = (degrees[axis],)
    return out


def accumulation_sizes(strategy, world: int):
    """Micro-batch sizes (per data-parallel rank) the search without pipelines may take so that the priced
    micro-batch count equals the user's ``gradient_accumulation_steps`` (the loop runs that many); None when
    the user left it at 1. ValueError when the global batch does not split into that many."""
    from autoparallel.planner.search import divisors

    k, batch = strategy.gradient_accumulation_steps, strategy.global_batch_size
    if k <= 1 or batch is None:
        return None
    if batch % k:
        raise ValueError(f"auto_mode='full': gradient_accumulation_steps={k} (kept: the loop's forwards per "
                         f"optimizer step) does not divide global_batch_size={batch}; expected a multiple of {k}")
    return tuple(sorted({batch // (k * d) for d in divisors(world) if (batch // k) % d == 0}))


def same_loop(config, strategy) -> bool:
    """A candidate without pipelines runs the user's accumulation count (see ``accumulation_sizes``)."""
    k = strategy.gradient_accumulation_steps
    return k <= 1 or config.pp > 1 or config.num_micro_batches(strategy.global_batch_size) == k


def with_tp_plan(fixed: dict, tp_plan, world: int) -> dict:
    """A ``tp_plan`` shards layers over the tensor-parallel group: only tp > 1 keeps it."""
    from autoparallel.planner.search import divisors

    tps = tuple(t for t in divisors(world) if t > 1 and t in fixed.get("tp", (t,)))
    if not tps:
        given = f"tensor_parallel.degree={fixed['tp'][0]}" if "tp" in fixed else f"a world of {world} rank(s)"
        raise ValueError(f"auto_mode='full': tp_plan={{{', '.join(map(repr, tp_plan))}}} shards layers over the "
                         f"tensor-parallel group, which needs tp > 1, but {given} leaves tp=1; drop tp_plan or "
                         f"give more ranks")
    return dict(fixed, tp=tps)


def narrowed(constraints: dict, fixed: dict):
    """``constraints`` narrowed to the fixed values, or (None, why) when the search allows none of them."""
    out = dict(constraints)
    for knob, values in fixed.items():
        allowed = constraints.get(knob)
        keep = tuple(v for v in values if allowed is None or v in allowed)
        if not keep:
            return None, (f"{NAMES[knob]}={_shown(knob, values[0])} is outside this search "
                          f"({knob} among {list(allowed)})")
        out[knob] = list(keep)
    return out, None


def _shown(knob, value):
    return bool(value) if knob == "sp" else value


def describe(fixed: dict) -> str:
    """The explanation's line naming what the user fixed ("" when nothing)."""
    if not fixed:
        return ""
    return "fixed by the strategy, mesh or tp_plan: " + ", ".join(_one(k, v) for k, v in fixed.items())


def _one(knob, values) -> str:
    return f"{NAMES[knob]}={_shown(knob, values[0])}" if len(values) == 1 else f"{NAMES[knob]} among {list(values)}"


def check_kept(chosen, fixed: dict) -> None:
    """The chosen strategy honours every fixed value (a guard: a choice silently ignoring one raises)."""
    got = {"dp": chosen.data_parallel.degree, "tp": chosen.tensor_parallel.degree,
           "pp": chosen.pipeline_parallel.degree, "sp": int(chosen.sequence_parallel.enable),
           "sharding": chosen.sharding.stage if chosen.sharding.enable else 0,
           "recompute": chosen.recompute.granularity if chosen.recompute.enable else "none"}
    bad = [f"{_one(k, v)} (the plan has {_shown(k, got[k])})" for k, v in fixed.items() if got[k] not in v]
    if bad:
        raise ValueError(f"auto_mode='full': the plan for this model cannot keep {', '.join(bad)}; expected "
                         f"the defaults (the planner picks them), or auto_mode='semi' to set them yourself")
