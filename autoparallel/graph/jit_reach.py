"""What a function decorated with ``paddle.jit.to_static`` reaches: distributed tensors among its arguments,
its bound instance, the globals it reads and its closure (then autoparallel lowers or runs it), and
pipeline-parallel models (``PipelineModule``: they run in dygraph mode, see ``reaches_pipeline``)."""
from __future__ import annotations

import sys
import types

from autoparallel import compat, layer_state


def _dist(x) -> bool:
    from autoparallel.dist_tensor import is_dist

    return is_dist(x)


def _layer_is_dist(layer) -> bool:
    if layer_state.mesh_of(layer) is not None:
        return True
    return any(_dist(p) for p in layer.parameters())


def is_pipeline(v) -> bool:
    """A pipeline-parallel model, or one of its bound methods (``pipe.train_batch``)."""
    runtime = sys.modules.get("autoparallel.parallel.pipeline.runtime")
    if runtime is None:                       # no pipeline exists before its module is imported
        return False
    return isinstance(v, runtime.PipelineModule) or isinstance(getattr(v, "__self__", None), runtime.PipelineModule)


def _value_is_dist(v, depth: int = 0) -> bool:
    from paddle import nn

    if _dist(v) or is_pipeline(v):
        return True
    if isinstance(v, nn.Layer):
        return _layer_is_dist(v)
    if depth < 2 and isinstance(v, (list, tuple)):
        return any(_value_is_dist(u, depth + 1) for u in v)
    if depth < 2 and isinstance(v, dict):
        return any(_value_is_dist(u, depth + 1) for u in v.values())
    inner = getattr(v, "_layers", None) or getattr(v, "_model", None)     # DataParallel-style wrappers
    if depth < 2 and inner is not None and inner is not v:
        return _value_is_dist(inner, depth + 1)
    return False


def _code_names(code) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _referenced(fn) -> list:
    """Values the function's code names: globals it reads and its closure cells."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    g = getattr(fn, "__globals__", {})
    out = [g[n] for n in _code_names(code) if n in g and not isinstance(g[n], types.ModuleType)]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:                                # an empty cell
            pass
    return out


def reaches_pipeline(sf, args, kwargs) -> bool:
    """Whether the decorated function is, is a method of, takes or names a pipeline-parallel model."""
    fn = compat.dygraph_function(sf)
    inst = getattr(sf, "_class_instance", None)
    inst = inst() if callable(inst) else inst
    values = [fn, inst, *args, *kwargs.values(), *_referenced(fn)]
    return any(is_pipeline(v) for v in values)


def touches_dist(sf, args, kwargs) -> bool:
    """Whether the decorated function reaches distributed tensors (module docstring)."""
    if is_pipeline(compat.dygraph_function(sf)):
        return True
    if any(_value_is_dist(a) for a in args) or any(_value_is_dist(v) for v in kwargs.values()):
        return True
    inst = getattr(sf, "_class_instance", None)
    inst = inst() if callable(inst) else inst
    if inst is not None and _value_is_dist(inst):
        return True
    return any(_value_is_dist(v) for v in _referenced(compat.dygraph_function(sf)))


PIPELINE_WHY = ("it calls a pipeline-parallel model, whose schedule runs stage by stage in Python (transfers "
                "between stages, micro-batches interleaved), which no one static program holds")
SIMULATED_WHY = "the simulated world holds every rank in this process, and a static program is one rank's"


def dygraph_reason(sf, args, kwargs, simulated: bool):
    """Why a decorated function that reaches distributed tensors runs in dygraph mode, or None (it is lowered)."""
    if reaches_pipeline(sf, args, kwargs):
        return PIPELINE_WHY
    return SIMULATED_WHY if simulated else None
