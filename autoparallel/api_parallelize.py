"""``ap.parallelize`` in both call forms: this project's and paddle's intermediate API.

    model, opt = ap.parallelize(model, opt, strategy=s, tp_plan={...})          # ours (Strategy)
    model, opt = ap.parallelize(model, opt, mesh, {"dp_config": {"sharding_level": 1},       # paddle's
                                                   "mp_config": {"parallelize_plan": {...}}})

paddle's form: the third positional argument is a ProcessMesh (ours or ``paddle.distributed.ProcessMesh``) and
the fourth a config dict. Mesh dims are named as paddle names them (``dp``, ``mp``, ``pp``) or as this project
does (``data``, ``model``, ``pipe``); their sizes are the degrees. The config becomes a Strategy
(``strategy_from_config``) and the build is ours. Everything the config can say is honoured or refused:
``dp_config.sharding_level`` 0-3 (ZeRO stage over the data dim), ``mp_config.parallelize_plan`` (the tensor-
parallel plan), ``pp_config.split_spec`` as a layer-name prefix (balanced split) or a dict of ``SplitPoint``s on
the blocks (the stage starts); ``global_spec`` and ``cp_config`` are refused.
"""
from __future__ import annotations

import numpy as np
from paddle.distributed import SplitPoint  # noqa: F401  (paddle's enum: ap.SplitPoint.END in pp_config split_spec)

from autoparallel.api_prepare import split_prepares
from autoparallel.core.mesh import ProcessMesh, as_mesh

__all__ = ["paddle_form", "strategy_from_config", "mesh_degrees"]

# paddle's mesh dim names -> ours
DIM_NAMES = {"dp": "data", "data": "data", "mp": "model", "model": "model", "tp": "model", "pp": "pipe",
             "pipe": "pipe"}
CONFIG_KEYS = {"dp_config": ("sharding_level", "sharding_mesh_dim"), "mp_config": ("parallelize_plan",),
               "pp_config": ("split_spec", "global_spec"), "cp_config": ("parallelize_plan",)}


def _is_mesh(x) -> bool:
    return isinstance(x, ProcessMesh) or (type(x).__module__.startswith("paddle") and hasattr(x, "dim_names")
                                          and hasattr(x, "process_ids"))


def paddle_form(model, strategy, mesh, config, tp_plan):
    """(strategy, mesh, tp_plan, prepare hooks) for ``ap.parallelize``'s arguments: paddle's
    ``(model, optimizer, mesh, config)`` form translated (see the module docstring); this project's form passes
    through unchanged. A ``paddle.distributed.Strategy`` is converted field by field (config/paddle_compat.py);
    PrepareLayerInput/Output entries of the plan are split off (api_prepare.py)."""
    from autoparallel.api_strategy import as_strategy

    strategy = as_strategy(strategy)
    if _is_mesh(strategy):                       # paddle's positional order: (model, optimizer, mesh, config)
        if mesh is not None and not isinstance(mesh, dict):
            raise TypeError(f"ap.parallelize(model, optimizer, mesh, config): the fourth argument is paddle's config "
                            f"dict, got {type(mesh).__name__}")
        if isinstance(mesh, dict) and config is not None:
            raise TypeError("ap.parallelize: config given twice (positionally and as config=)")
        strategy, mesh, config = None, strategy, (mesh if isinstance(mesh, dict) else config)
    derive = mesh is not None and _is_mesh(mesh) and (strategy is None or _paddle_named(mesh))
    if config is not None or derive:             # the mesh's dim sizes are the degrees
        strategy, mesh, tp_plan = strategy_from_config(config or {}, mesh, strategy, tp_plan)
        _check_split(model, (config or {}).get("pp_config"), strategy)
        _check_sp_keys(model, (config or {}).get("mp_config"))
    tp_plan, prepares = split_prepares(tp_plan)
    if tp_plan and config is not None and strategy.tensor_parallel.degree == 1:
        # paddle's: a plan over a size-1 'mp' dim (a script run with mp = 1) keeps every layer whole; its keys
        # must still name layers (a typo is refused as with mp > 1)
        from autoparallel.parallel.tensor_parallel import match_plan

        match_plan(model, tp_plan)
        tp_plan = None
    if prepares and strategy is not None and strategy.pipeline_parallel.degree > 1:
        raise NotImplementedError("ap.parallelize: PrepareLayerInput/Output hooks with pipeline parallelism (the "
                                  "model is rebuilt into stages) are not supported")
    if isinstance(tp_plan, dict) and not tp_plan and prepares:
        tp_plan = None
    return strategy, mesh, tp_plan, prepares


def _paddle_named(mesh) -> bool:
    """A mesh not already in this project's [data, model] form (paddle's dim names, or a paddle mesh)."""
    return not isinstance(mesh, ProcessMesh) or mesh.dim_names != ["data", "model"]


def mesh_degrees(mesh) -> dict:
    """{"data": dp, "model": tp, "pipe": pp} from a mesh's dim names (paddle's or ours); other names raise."""
    out = {"data": 1, "model": 1, "pipe": 1}
    seen = set()
    for name, size in zip(mesh.dim_names, mesh.shape):
        ours = DIM_NAMES.get(name)
        if ours is None:
            raise ValueError(f"ap.parallelize: mesh dim {name!r} has no meaning here; name the mesh dims from "
                             f"{sorted(DIM_NAMES)} (dp / data: data parallel, mp / model / tp: tensor parallel, "
                             f"pp / pipe: pipeline), got {mesh.dim_names}")
        if ours in seen:
            raise ValueError(f"ap.parallelize: mesh dims {mesh.dim_names} name the {ours} axis twice")
        seen.add(ours)
        out[ours] = int(size)
    return out


def _our_mesh(mesh, degrees) -> ProcessMesh:
    """The same ranks as a mesh in this project's dim order: [data, model], or [pipe, data, model] with pp > 1."""
    names = [DIM_NAMES[n] for n in mesh.dim_names]
    order = [n for n in ("pipe", "data", "model") if n in names]
    arr = np.transpose(np.asarray(mesh.mesh), [names.index(n) for n in order])
    if degrees["pipe"] > 1:
        return ProcessMesh(arr.tolist(), order)
    arr = arr.reshape(degrees["data"], degrees["model"])
    return ProcessMesh(arr.tolist(), ["data", "model"])


def strategy_from_config(config: dict, mesh=None, strategy=None, tp_plan=None):
    """(Strategy, mesh in our dim order, tp_plan) for paddle's ``config`` dict over ``mesh``."""
    from autoparallel.strategy import Strategy

    if not isinstance(config, dict):
        raise TypeError(f"ap.parallelize: config must be a dict with keys from {sorted(CONFIG_KEYS)}, got "
                        f"{type(config).__name__}")
    _check_keys(config)
    if mesh is None:
        raise ValueError("ap.parallelize(model, optimizer, mesh, config): paddle's config form needs the mesh (its "
                         "dim sizes are the degrees); pass mesh=ap.ProcessMesh(..., dim_names=['dp', 'mp'])")
    mesh = as_mesh(mesh)
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"ap.parallelize: mesh must be an ap.ProcessMesh, got {type(mesh).__name__} {mesh!r:.60}")
    deg = mesh_degrees(mesh)
    s = Strategy() if strategy is None else strategy.copy()
    _check_agree(s, deg, mesh)
    s.data_parallel.degree, s.tensor_parallel.degree = deg["data"], deg["model"]
    s.pipeline_parallel.degree = deg["pipe"]
    _dp_config(s, config.get("dp_config"), mesh)
    plan, sp = _mp_config(config.get("mp_config"), tp_plan)
    if (sp or split_prepares(plan)[0]) and "model" not in {DIM_NAMES[n] for n in mesh.dim_names}:
        raise ValueError(f"ap.parallelize: the tensor-parallel plan (keys {sorted(plan or {})[:6]}) shards layers over "
                         f"the mesh's 'mp' dim, but the mesh {mesh.dim_names} {mesh.shape} has none; add an 'mp' dim "
                         f"(size 1 keeps every layer whole) or drop the plan")
    if sp and deg["model"] > 1:                  # over a size-1 'mp' dim a sequence shard is the whole sequence
        s.sequence_parallel.enable = True
    _pp_config(config.get("pp_config"))
    if config.get("cp_config") is not None:
        raise NotImplementedError("ap.parallelize: cp_config (context parallelism, ring attention) is not supported; "
                                  "drop cp_config")
    return s, _our_mesh(mesh, deg), plan


def _check_agree(s, deg, mesh) -> None:
    """Degrees the strategy sets explicitly must be the mesh's."""
    given = {"data": (s.data_parallel.degree, None), "model": (s.tensor_parallel.degree, 1),
             "pipe": (s.pipeline_parallel.degree, 1)}
    bad = [f"{axis}: strategy {v}, mesh {deg[axis]}" for axis, (v, default) in given.items()
           if v != default and v != deg[axis]]
    if bad:
        raise ValueError(f"ap.parallelize: the strategy's degrees disagree with the mesh {mesh.dim_names} "
                         f"{mesh.shape} ({'; '.join(bad)}); the mesh's dim sizes are the degrees")


def _check_keys(config):
    for key, value in config.items():
        if key not in CONFIG_KEYS:
            raise ValueError(f"ap.parallelize: unknown config key {key!r}; expected keys from {sorted(CONFIG_KEYS)}")
        if value is None:
            continue
        if not isinstance(value, dict):
            raise TypeError(f"ap.parallelize: config[{key!r}] must be a dict, got {type(value).__name__}")
        bad = [k for k in value if k not in CONFIG_KEYS[key]]
        if bad:
            raise ValueError(f"ap.parallelize: config[{key!r}] has unknown keys {bad}; expected {CONFIG_KEYS[key]}")


def _dp_config(s, dp, mesh):
    if dp is None:
        return
    given = dp.get("sharding_level")
    level = {None: 0, "0": 0, "1": 1, "2": 2, "3": 3}.get(given, given) if isinstance(given, (str, type(None))) \
        else given                                    # paddle takes ints, digit strings and None (pure dp)
    if type(level) is not int or level not in (0, 1, 2, 3):
        raise ValueError(f"ap.parallelize: dp_config['sharding_level'] must be 0, 1, 2 or 3 (int or str), got "
                         f"{given!r}")
    dim = dp.get("sharding_mesh_dim", "dp")
    name = DIM_NAMES.get(dim if isinstance(dim, str) else mesh.dim_names[dim] if isinstance(dim, int)
                         and -mesh.ndim <= dim < mesh.ndim else None)
    if name != "data":
        raise NotImplementedError(f"ap.parallelize: dp_config['sharding_mesh_dim']={dim!r}: sharding runs over the "
                                  f"data-parallel mesh dim ('dp' / 'data') only")
    have = s.sharding.stage if s.sharding.enable else 0
    if "sharding_level" in dp and s.sharding.enable and have != level:     # one of the two would be ignored
        raise ValueError(f"ap.parallelize: dp_config['sharding_level']={given!r} disagrees with the strategy's "
                         f"sharding (enable=True, stage={have}); give the ZeRO stage once, or agreeing values")
    if level:
        s.sharding.enable, s.sharding.stage = True, level


SP_STYLES = ("SequenceParallelBegin", "SequenceParallelEnd", "SequenceParallelEnable", "SequenceParallelDisable")


def _mp_config(mp, tp_plan):
    """(tensor-parallel plan, whether paddle's SequenceParallel* entries turn sequence parallelism on)."""
    plan = (mp or {}).get("parallelize_plan")
    if plan is None:
        return tp_plan, False
    if not isinstance(plan, dict):
        raise TypeError(f"ap.parallelize: mp_config['parallelize_plan'] must be a dict {{layer name: plan}}, got "
                        f"{type(plan).__name__}")
    if tp_plan:
        raise ValueError("ap.parallelize: the tensor-parallel plan is given twice (tp_plan= and "
                         "mp_config['parallelize_plan']); give one")
    out, sp = {}, False
    for key, value in plan.items():
        if not isinstance(key, str):
            raise TypeError(f"ap.parallelize: parallelize_plan keys are layer (or parameter) names, got {key!r}")
        if "?" in key or "[!" in key:        # read one way by paddle's regex, another by our pattern
            raise ValueError(f"ap.parallelize: parallelize_plan key {key!r}: paddle reads keys as regular expressions "
                             f"('?': optional, '[!..]': '!' or ..), this project as name patterns ('?': one "
                             f"character, '[!..]': none of ..); write it without '?' / '[!' ('layers.*.mlp', "
                             f"'[0-3]' and exact names mean the same in both)")
        layer = key.rsplit(".", 1)[0] if key.endswith((".weight", ".bias")) and "." in key else key
        if value is None or (isinstance(value, (list, tuple)) and any(v is None for v in value)):
            raise TypeError(f"ap.parallelize: parallelize_plan[{key!r}] is {value!r}; a plan value is a style "
                            f"(ColWiseParallel(), ...) or a list of styles")
        value, prepares = _without_prepares(value)
        if prepares:
            out.setdefault("__prepares__", []).extend((layer, p) for p in prepares)
        value, kinds = _without_sp(value)
        sp = sp or bool(kinds)
        if "SequenceParallelEnable" in kinds:          # this layer runs on sequence shards
            if value is not None:
                raise ValueError(f"ap.parallelize: parallelize_plan[{key!r}] combines SequenceParallelEnable with "
                                 f"another style; a sequence-parallel layer holds no tensor-parallel weights")
            from autoparallel.parallel.tensor_parallel import SequenceParallel

            value = SequenceParallel()
        if value is None:
            continue
        style = _style(value, key)
        if out.get(layer, style) != style:
            raise ValueError(f"ap.parallelize: parallelize_plan gives layer {layer!r} two styles "
                             f"({out[layer]} and {style})")
        out[layer] = style
    extra = out.pop("__prepares__", [])
    return _with_prepares(out, extra), sp


def _check_sp_keys(model, mp) -> None:
    """paddle's SequenceParallel* entries only switch sequence parallelism on, but their keys must still name
    layers of the model: a key matching none (a typo) is refused like any other plan key."""
    from autoparallel.parallel.tensor_parallel import PlanError, name_matches

    names = [n for n, _ in model.named_sublayers() if n]
    for key, value in ((mp or {}).get("parallelize_plan") or {}).items():
        if _without_sp(value)[1] and not any(name_matches(n, key) for n in names):
            raise PlanError(f"ap.parallelize: parallelize_plan key {key!r} ({', '.join(_without_sp(value)[1])}) "
                            f"matches no layer of {type(model).__name__}")


def _without_sp(value):
    """(the value without paddle's SequenceParallel* entries or None if nothing else, their class names)."""
    if value is None:
        return None, []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    is_sp = [type(i).__module__.startswith("paddle") and type(i).__name__ in SP_STYLES for i in items]
    kinds = [type(i).__name__ for i, f in zip(items, is_sp) if f]
    rest = [i for i, f in zip(items, is_sp) if not f]
    if not rest:
        return None, kinds
    return (rest if isinstance(value, (list, tuple)) else rest[0]), kinds


def _without_prepares(value):
    """(the value without PrepareLayerInput/Output entries or None if nothing else, the prepare entries)."""
    from autoparallel.api_prepare import as_prepare

    items = list(value) if isinstance(value, (list, tuple)) else [value]
    prepares = [p for p in map(as_prepare, items) if p is not None]
    rest = [i for i in items if as_prepare(i) is None]
    if not rest:
        return None, prepares
    return (rest if isinstance(value, (list, tuple)) else rest[0]), prepares


def _with_prepares(plan: dict, prepares: list) -> dict:
    """The plan with its prepare entries back as one-entry lists (split again by split_prepares)."""
    for layer, p in prepares:
        plan[layer] = ([plan[layer]] if layer in plan else []) + [p]
    return plan


def _style(value, key):
    """One of our styles for a plan value: ours, paddle's ColWise/RowWiseParallel, or a one-style list."""
    from autoparallel.parallel.tensor_parallel import ColWiseParallel, RowWiseParallel

    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise NotImplementedError(f"ap.parallelize: parallelize_plan[{key!r}] lists {len(value)} styles; one "
                                      f"style per layer is supported (sequence parallel: "
                                      f"strategy.sequence_parallel.enable)")
        return _style(value[0], key)
    if not type(value).__module__.startswith("paddle"):
        return value                         # ours (checked by the tensor-parallel plan matcher)
    name = type(value).__name__
    if name == "ColWiseParallel":
        return ColWiseParallel(gather_output=bool(value.gather_output))
    if name == "RowWiseParallel":
        return RowWiseParallel(is_input_parallel=bool(value.is_input_parallel))
    raise NotImplementedError(f"ap.parallelize: parallelize_plan[{key!r}] = paddle.distributed.{name} is not "
                              f"supported; styles here: ap.ColWiseParallel, ap.RowWiseParallel, "
                              f"ap.VocabParallelEmbedding, ap.SequenceParallel (and strategy.sequence_parallel)")


def _pp_config(pp):
    if pp is None:
        return
    if pp.get("global_spec") is not None:
        raise NotImplementedError(f"ap.parallelize: pp_config['global_spec']={pp['global_spec']!r} is not supported "
                                  f"(layers shared by every stage are found from tied parameters); drop it")
    split = pp.get("split_spec")
    if split is not None and not isinstance(split, (str, list, tuple, dict)):
        raise TypeError(f"ap.parallelize: pp_config['split_spec'] is a layer-list prefix (str, or a list of one), or "
                        f"a dict {{layer name: SplitPoint.END / BEGINNING}}, got {type(split).__name__}")


def _check_split(model, pp, strategy) -> None:
    """``split_spec`` as a prefix (a string or a list of one) naming the block list the pipeline splits: the
    balanced split; as a dict of ``SplitPoint``s on that list's blocks: ``strategy.pipeline_parallel.split_points``
    (``{"blocks.1": END}`` and ``{"blocks.2": BEGINNING}`` both start stage 2 at ``blocks.2``)."""
    split = (pp or {}).get("split_spec")
    if split is None:
        return
    if strategy.pipeline_parallel.degree == 1:
        raise ValueError(f"ap.parallelize: pp_config['split_spec']={split!r} splits a pipeline, but the mesh has no "
                         f"'pp' dim of size > 1")
    from autoparallel.parallel.pipeline.stage import describe_model

    pieces = describe_model(model)
    found = pieces.layers_name
    if isinstance(split, dict):
        points = _split_points(split, pieces.layer_names)
        have = list(strategy.pipeline_parallel.split_points)
        if have and have != points:
            raise ValueError(f"ap.parallelize: pp_config['split_spec'] starts stages at {points}, the strategy's "
                             f"pipeline_parallel.split_points at {have}; give the split once")
        strategy.pipeline_parallel.split_points = points
        return
    prefixes = [split] if isinstance(split, str) else list(split)
    if prefixes != [found]:
        raise NotImplementedError(f"ap.parallelize: pp_config['split_spec']={split!r}: the pipeline splits the "
                                  f"block list {found!r} of {type(model).__name__}; give that prefix (or drop "
                                  f"split_spec)")


def _split_points(spec: dict, blocks: list) -> list:
    """The first block of stages 2..n for paddle's ``{layer name: SplitPoint}``: after an END layer, at a
    BEGINNING one."""
    if not spec:
        raise ValueError("ap.parallelize: pp_config['split_spec'] is an empty dict; give one SplitPoint per stage "
                         "boundary (pp - 1 of them), or the block-list prefix for a balanced split")
    starts = []
    for name, point in spec.items():
        kind = getattr(point, "name", None) if type(point).__name__ == "SplitPoint" else None
        if kind not in ("END", "BEGINNING"):
            raise TypeError(f"ap.parallelize: pp_config['split_spec'][{name!r}] must be "
                            f"paddle.distributed.SplitPoint.END or .BEGINNING, got {point!r}")
        if name not in blocks:
            raise NotImplementedError(f"ap.parallelize: pp_config['split_spec'] key {name!r}: stages are cut between "
                                      f"the blocks {blocks[0]} .. {blocks[-1]} only; name one of them")
        i = blocks.index(name) + (kind == "END")
        if not 0 < i < len(blocks):
            raise ValueError(f"ap.parallelize: pp_config['split_spec'] {{{name!r}: SplitPoint.{kind}}} leaves a "
                             f"stage empty ({name!r} is the {'last' if i else 'first'} block)")
        starts.append(i)
    if starts != sorted(set(starts)):
        raise ValueError(f"ap.parallelize: pp_config['split_spec'] must cut the blocks in model order without "
                         f"repeats, got {spec!r}")
    return [blocks[i] for i in starts]
