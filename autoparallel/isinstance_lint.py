"""A warning for model code that branches on ``isinstance(v, paddle.Tensor)``.

A distributed activation is not a ``paddle.Tensor`` (docs/design.md: paddle's C++ kernels would read storage it does
not have), so ``if isinstance(mask, paddle.Tensor): x = x * mask`` in a layer's ``forward`` takes its non-tensor
branch for a distributed ``mask``: no error, a different result. When a model is laid out (``shard_layer``,
``parallelize``), the ``forward`` of each of its layer classes outside paddle is read once; a test of
``paddle.Tensor`` (or ``Tensor``) there gets a RuntimeWarning naming the class, the line and ``paddle.is_tensor``,
which holds for distributed tensors.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import warnings

_SEEN: set = set()


def _names_tensor(node) -> bool:
    """``paddle.Tensor``, ``Tensor``, ``paddle.base.framework.core.eager.Tensor``..., or a tuple holding one."""
    if isinstance(node, ast.Tuple):
        return any(_names_tensor(e) for e in node.elts)
    return (isinstance(node, ast.Attribute) and node.attr == "Tensor") or (
        isinstance(node, ast.Name) and node.id == "Tensor")


def tensor_tests(fn) -> list:
    """Line numbers (in the file) of ``isinstance(x, paddle.Tensor)`` calls in ``fn``'s source."""
    try:
        lines, start = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return []
    return [start + node.lineno - 1 for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
            and len(node.args) == 2 and _names_tensor(node.args[1])]


def warn_tensor_tests(layer) -> None:
    """One RuntimeWarning per layer class (per process) whose ``forward`` tests ``isinstance(.., paddle.Tensor)``."""
    for sub in layer.sublayers(include_self=True):
        cls = type(sub)
        if cls in _SEEN:
            continue
        _SEEN.add(cls)
        forward = getattr(cls, "forward", None)
        if forward is None or (getattr(cls, "__module__", "") or "").startswith("paddle."):
            continue
        lines = tensor_tests(forward)
        if lines:
            where = inspect.getsourcefile(forward) or cls.__module__
            warnings.warn(f"{cls.__qualname__}.forward ({where}, line {', '.join(map(str, lines))}) tests "
                          f"isinstance(..., paddle.Tensor): a distributed tensor is not a paddle.Tensor, so that "
                          f"branch takes its non-tensor path for one (a mask or a loss term skipped, with no "
                          f"error); paddle.is_tensor(x) holds for both", RuntimeWarning, stacklevel=3)
