"""Dict-returning rules (the article's form), adapted onto the registry::

    @register_spmd_rule("flash_attention")
    def rule(inputs, outputs, attrs, mesh):
        q, k, v = inputs                       # the DistSpecs of the call's distributed inputs, in call order
        pl = [Shard(1)] if q.placements[0].is_shard(1) else [Replicate()]
        return {"inputs": {"q": pl, "k": pl, "v": pl}, "outputs": {"out": pl}}

A rule whose parameters are exactly ``(inputs, outputs, attrs, mesh)`` is this form. ``outputs`` are the
op's output specs (global shape and dtype; placements Replicate, the rule decides them), ``attrs`` the
call's non-tensor arguments by parameter name, ``mesh`` the inputs' mesh. The rule returns placements:
``"inputs"`` one entry per distributed input (matched by the op's parameter names when the keys are those
names, else in order), ``"outputs"`` one per output the op returns (``None`` outputs skipped). Placement
lists shorter than the mesh are padded with Replicate. Anything else is an error naming the rule and the
field. The op runs itself on the local shards (no local_op).

Output shapes come from the rule the name had before (a built-in rule doubles as a shape function), else
from paddle's shape inference of the op at the global shapes (autoparallel/rule_shapes.py, which needs
paddle; the rest of this module is pure).
"""
from __future__ import annotations

import inspect

from autoparallel.core.placement import Placement, Replicate, Shard, parse_placement
from autoparallel.core.spec import DistSpec

from spmd_rules.result import SpmdResult

PARAMS = ("inputs", "outputs", "attrs", "mesh")


def is_dict_rule(fn) -> bool:
    try:
        names = [p.name for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError):
        return False
    return names == list(PARAMS)


def adapt(name: str, fn, prior=None):
    """A registry rule ``(*specs, **attrs) -> SpmdResult`` calling the dict rule ``fn``."""
    from spmd_rules.registry import flatten_specs

    def rule(*args, **kwargs):
        given = flatten_specs(args, kwargs)
        if not given:
            raise ValueError(f"spmd rule {name!r}: the call has no distributed input")
        mesh = given[0].mesh
        outs = _output_specs(name, prior, args, kwargs)
        carriers = [o.with_placements([Replicate()] * mesh.ndim) for o in outs if o is not None]
        names, attrs = _names_and_attrs(prior, args, kwargs, len(given))
        result = fn(list(given), carriers, attrs, mesh)
        return to_result(name, result, given, names, outs, mesh)

    rule.__name__ = getattr(fn, "__name__", name)
    rule.__doc__ = fn.__doc__
    rule.dict_rule = fn
    return rule


def _output_specs(name, prior, args, kwargs) -> tuple:
    if prior is not None:
        return tuple(prior(*args, **kwargs).outputs)
    import importlib

    return importlib.import_module("autoparallel.rule_shapes").infer_output_specs(name, args, kwargs)


def _names_and_attrs(prior, args, kwargs, n_specs):
    """The parameter name of every distributed input (None when unknown) and the other arguments by name."""
    params = []
    if prior is not None and prior._sig is not None:
        params = [p.name for p in prior._sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names, attrs = [], {}
    for i, a in enumerate(args):
        key = params[i] if i < len(params) else f"arg{i}"
        if _has_spec(a):
            names.append(key if i < len(params) else None)
        else:
            attrs[key] = a
    for k, v in kwargs.items():
        if _has_spec(v):
            names.append(k)
        else:
            attrs[k] = v
    return (names if len(names) == n_specs else [None] * n_specs), attrs


def _has_spec(v) -> bool:
    return isinstance(v, DistSpec) or (isinstance(v, (list, tuple)) and any(_has_spec(x) for x in v))


def to_result(name, result, given, names, outs, mesh) -> SpmdResult:
    """Validate the rule's dict and build the SpmdResult (errors name the rule and the field)."""
    if not isinstance(result, dict):
        raise TypeError(f"spmd rule {name!r} must return a dict {{'inputs': {{...}}, 'outputs': {{...}}}}, "
                        f"got {type(result).__name__}")
    unknown = sorted(set(result) - {"inputs", "outputs"})
    missing = [k for k in ("inputs", "outputs") if k not in result]
    if unknown or missing:
        raise ValueError(f"spmd rule {name!r}: the returned dict must have the keys 'inputs' and 'outputs'; "
                         f"missing {missing}, unknown {unknown}")
    ins = _entries(name, "inputs", result["inputs"], len(given), names)
    present = [o for o in outs if o is not None]
    outs_pl = _entries(name, "outputs", result["outputs"], len(present), [None] * len(present))
    inputs = tuple(g.with_placements(_placements(name, f"inputs[{k!r}]", v, mesh, len(g.shape)))
                   for g, (k, v) in zip(given, ins))
    it = iter(outs_pl)
    outputs = []
    for o in outs:
        if o is None:
            outputs.append(None)
            continue
        k, v = next(it)
        outputs.append(DistSpec(mesh, _placements(name, f"outputs[{k!r}]", v, mesh, len(o.shape)), o.shape, o.dtype))
    return SpmdResult(inputs, tuple(outputs))


def _entries(name, field, d, n, names) -> list:
    """[(key, placements)] in the order of the call's inputs / the op's outputs."""
    if not isinstance(d, dict):
        raise TypeError(f"spmd rule {name!r}: field {field!r} must be a dict {{name: placements}}, "
                        f"got {type(d).__name__}")
    if len(d) != n:
        what = "distributed input" if field == "inputs" else "output"
        known = f" ({', '.join(x for x in names if x)})" if any(names) else ""
        raise ValueError(f"spmd rule {name!r}: field {field!r} has {len(d)} entries {list(d)}, expected {n} "
                         f"(one per {what} of the call{known})")
    if all(names) and set(d) == set(names):
        return [(k, d[k]) for k in names]
    return list(d.items())


def _placements(name, field, value, mesh, ndim) -> tuple:
    if isinstance(value, (Placement, str)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"spmd rule {name!r}: field {field} must be a list of placements (Shard/Replicate/"
                        f"Partial), got {value!r}")
    try:
        pl = tuple(parse_placement(p) for p in value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"spmd rule {name!r}: field {field} holds an invalid placement: {e}") from None
    if len(pl) > mesh.ndim:
        raise ValueError(f"spmd rule {name!r}: field {field} has {len(pl)} placements {[str(p) for p in pl]}, "
                         f"but the mesh has {mesh.ndim} dims {mesh.dim_names}")
    pl = pl + (Replicate(),) * (mesh.ndim - len(pl))
    for p in pl:
        if isinstance(p, Shard) and not p.dim < ndim:
            raise ValueError(f"spmd rule {name!r}: field {field} shards dim {p.dim} of a tensor of rank {ndim}")
    return pl
