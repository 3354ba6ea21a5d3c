"""paddle's ``PrepareLayerInput(fn)`` / ``PrepareLayerOutput(fn)`` plan entries: ``fn(process_mesh=mesh)`` returns a
forward pre-hook (``hook(layer, inputs)``) / post-hook (``hook(layer, inputs, output)``) for the layers the plan
key names.

    plan = {"blocks.*.mlp.fc1": [ap.ColWiseParallel(), ap.PrepareLayerOutput(lambda process_mesh: to_shard0)]}
    model, opt = ap.parallelize(model, opt, strategy=s, tp_plan=plan)      # or paddle's config form

The hooks are registered after the build, so they see the layer's final layouts and run after the
tensor-parallel style's own hooks; ``process_mesh`` is the model's mesh (``ap.mesh_of(model)``, dims
``[data, model]``). With pipeline parallelism (the model is rebuilt into stages) they are refused.
"""
from __future__ import annotations

__all__ = ["PrepareLayerInput", "PrepareLayerOutput", "split_prepares", "apply_prepares"]


class _Prepare:
    kind = ""

    def __init__(self, fn=None):
        if not callable(fn):
            raise TypeError(f"{type(self).__name__}(fn) expects a callable fn(process_mesh) returning the layer's "
                            f"forward {self.kind}-hook, got {type(fn).__name__}")
        self.fn = fn

    def __repr__(self):
        return f"{type(self).__name__}({getattr(self.fn, '__name__', self.fn)!r})"


class PrepareLayerInput(_Prepare):
    kind = "pre"

    def apply(self, layer, mesh):
        layer.register_forward_pre_hook(self.fn(process_mesh=mesh))


class PrepareLayerOutput(_Prepare):
    kind = "post"

    def apply(self, layer, mesh):
        layer.register_forward_post_hook(self.fn(process_mesh=mesh))


def as_prepare(value):
    """Ours for paddle's own PrepareLayerInput/Output objects; None for anything else."""
    if isinstance(value, _Prepare):
        return value
    name = type(value).__name__
    if type(value).__module__.startswith("paddle") and name in ("PrepareLayerInput", "PrepareLayerOutput"):
        return (PrepareLayerInput if name == "PrepareLayerInput" else PrepareLayerOutput)(value.fn)
    return None


def split_prepares(plan):
    """(plan without the prepare entries, [(pattern, prepare)]); a plan value may be one entry or a list."""
    if not isinstance(plan, dict):
        return plan, []
    out, prepares = {}, []
    for key, value in plan.items():
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        rest = []
        for item in items:
            p = as_prepare(item)
            if p is None:
                rest.append(item)
            else:
                prepares.append((key, p))
        if rest:
            out[key] = rest[0] if len(rest) == 1 else rest       # several styles: refused by the plan matcher
    return out, prepares


def apply_prepares(model, prepares) -> None:
    """Register every prepare hook on the layers its pattern names (after ``parallelize`` built ``model``)."""
    from autoparallel import layer_state
    from autoparallel.parallel.tensor_parallel import PlanError, name_matches

    build = layer_state.build_of(model)
    if build is not None and getattr(build, "pipe", None) is not None:
        raise NotImplementedError("PrepareLayerInput/Output hooks with pipeline parallelism (the model was rebuilt "
                                  "into stages) are not supported")
    mesh = layer_state.mesh_of(model)
    layers = [(n, l) for n, l in model.named_sublayers() if n]
    for pattern, prepare in prepares:
        hits = [l for n, l in layers if name_matches(n, pattern)]
        if not hits:
            raise PlanError(f"{prepare!r}: plan pattern {pattern!r} matches no layer of {type(model).__name__}")
        for layer in hits:
            prepare.apply(layer, mesh)
