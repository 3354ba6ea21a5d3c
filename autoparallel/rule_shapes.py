"""Output shapes of an op for a dict-returning spmd rule that has no shape function of its own.

Paddle's shape inference (InferMeta) builds a static program of the op at the global input shapes
without computing anything; the op is the ``ap.custom_op`` implementation of that name, else the paddle
function the op table routes to that name.
"""
from __future__ import annotations

import importlib

from autoparallel.placement import Replicate
from autoparallel.spec import DistSpec


def op_function(name: str):
    from autoparallel import dispatch

    fn = dispatch._CUSTOM.get(f"custom.{name}")
    if fn is not None:
        return fn
    from spmd_rules.op_table import OP_TABLE

    for path in OP_TABLE.get(name, ()):
        mod, _, attr = path.rpartition(".")
        try:
            obj = importlib.import_module(mod)
        except ImportError:
            continue
        f = getattr(obj, attr, None)
        if callable(f):
            return getattr(f, "__wrapped__", f)
    raise NotImplementedError(f"spmd rule {name!r} returns placements only and no op named {name!r} is known to "
                              f"infer its output shapes from; define the op with @ap.custom_op({name!r})")


def infer_output_specs(name: str, args, kwargs) -> tuple:
    """One DistSpec per output (Replicate placements; None for an absent output)."""
    import paddle

    from autoparallel.compat import no_dygraph
    from autoparallel.local_mode import local_mode
    from spmd_rules.registry import replace_specs, flatten_specs

    fn = op_function(name)
    specs = flatten_specs(args, kwargs)
    mesh = specs[0].mesh
    with no_dygraph(), local_mode():
        main, start = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, start):
            values = [paddle.static.data(f"_ap_in{i}", list(s.shape), s.dtype) for i, s in enumerate(specs)]
            a, k = replace_specs(args, kwargs, values)
            try:
                out = fn(*a, **k)
            except Exception as e:
                raise ValueError(f"spmd rule {name!r}: cannot infer the output shapes of the op at the global "
                                 f"input shapes {[list(s.shape) for s in specs]}: {e}") from e
    outs = out if isinstance(out, (list, tuple)) else (out,)
    rep = [Replicate()] * mesh.ndim
    return tuple(None if o is None else DistSpec(mesh, rep, tuple(int(d) for d in o.shape), _dtype(o.dtype))
                 for o in outs)


def _dtype(dtype) -> str:
    from autoparallel.spec import normalize_dtype

    return normalize_dtype(dtype)
