"""A model whose ``forward`` paddle's ``to_static`` replaced (``model = paddle.jit.to_static(model)``), then split
into pipeline stages: the stages run it in dygraph mode.

A stage runs the model's own forward with its blocks' ``forward`` swapped for proxies (auto_split.py): what one
call runs depends on the stage, and the schedule interleaves the stages' calls in Python, so no static program of
the whole forward exists, and paddle's translators cannot follow the proxies (the bytecode translator failed with
"no signature found for builtin SymbolicStaticFunction", the AST translator with "too many values to unpack").
``run_dygraph`` puts each such layer's own dygraph ``forward`` back (paddle keeps it in ``_original_funcs``) and
says so once with a ``UserWarning`` naming the layers; the pipeline then equals the eager model.
"""
from __future__ import annotations

import warnings

NOTICE = ("paddle.jit.to_static({names}): a pipeline-parallel model runs these forwards in dygraph mode, not as "
          "paddle static programs: its stages run the model's forward piece by piece (blocks swapped for proxies), "
          "interleaved by the schedule in Python, which no one static program holds")


def run_dygraph(model) -> list:
    """Names of the layers of ``model`` (the model itself is "") whose to_static forward was put back to dygraph."""
    from paddle.jit.dy2static.program_translator import StaticFunction

    undone = []
    for name, layer in model.named_sublayers(include_self=True):
        sf = layer.__dict__.get("forward")
        original = getattr(layer, "_original_funcs", {}).get("forward")
        if isinstance(sf, StaticFunction) and original is not None:
            layer.forward = original if hasattr(original, "__self__") else original.__get__(layer)
            undone.append(name or type(layer).__name__)
    if undone:
        warnings.warn(NOTICE.format(names=", ".join(undone)), UserWarning, stacklevel=4)
    return undone
