"""``paddle.jit.to_static`` over functions and layers that hold distributed tensors.

The article's static-mode snippet decorates a training step with paddle's own decorator::

    @paddle.jit.to_static
    def train_step(data):
        with auto_parallel.parallel_guard(["data"]):
            logits = model(data)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, labels))
        return loss

Neither of paddle's translators can run autoparallel's layouts: the bytecode translator (SOT) stops in
autoparallel's own Python, and the AST translator feeds ``pir.Value`` placeholders, which carry no layout,
into the routed ops. So ``install()`` (run with dispatch's) puts a check in front of paddle's
``StaticFunction.__call__``: a decorated function that touches distributed tensors — an argument, the layer
it is a method of, or a layer / tensor its code names through globals or closure cells — runs as written in
dygraph mode through autoparallel's dispatch (each routed call's layout plan cached after its first call),
and says so once per function with a one-line ``UserWarning``. It returns what the undecorated function
returns (a distributed loss on which ``backward()`` works), so it equals eager by construction; functions
over plain tensors are translated by paddle exactly as before.

If a distributed tensor still reaches a routed op while paddle builds a static program (a model the check
cannot see, e.g. reached through an attribute of a global object), ``check_static_call`` raises a
``NotImplementedError`` naming the op instead of computing on one shard's placeholder.

``ap.to_static(model, loader, loss_fn, optimizer)`` is the project's captured-graph mode (layouts
completed over the whole graph, then pinned); ``docs/static.md`` compares the step times.
"""
from __future__ import annotations

import types
import warnings

_INSTALLED = False
_NOTICED: set = set()
NOTICE = ("paddle.jit.to_static: {name} uses distributed tensors; it runs in dygraph mode through autoparallel's "
          "dispatch (layout plans cached per call), not as a paddle static program")


def install() -> None:
    """Wrap ``StaticFunction.__call__`` (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from paddle.jit.dy2static.program_translator import StaticFunction

    orig = StaticFunction.__call__

    def __call__(self, *args, **kwargs):
        if not getattr(self, "_property", False) and touches_dist(self, args, kwargs):
            _notice(self)
            return self._call_dygraph_function(*args, **kwargs)
        return orig(self, *args, **kwargs)

    __call__.__wrapped__ = orig
    StaticFunction.__call__ = __call__
    _INSTALLED = True


def _notice(sf) -> None:
    fn = getattr(sf, "_dygraph_function", None)
    key = getattr(fn, "__code__", None) or id(sf)
    if key in _NOTICED:
        return
    _NOTICED.add(key)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    warnings.warn(NOTICE.format(name=name), UserWarning, stacklevel=3)


# ---- what a decorated function touches -----------------------------------------------------------------------
def _dist(x) -> bool:
    from autoparallel.dist_tensor import is_dist

    return is_dist(x)


def _layer_is_dist(layer) -> bool:
    if getattr(layer, "_ap_mesh", None) is not None:
        return True
    return any(_dist(p) for p in layer.parameters())


def _value_is_dist(v, depth: int = 0) -> bool:
    from paddle import nn

    if _dist(v):
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


def touches_dist(sf, args, kwargs) -> bool:
    """Whether the decorated function reaches distributed tensors (module docstring)."""
    if any(_value_is_dist(a) for a in args) or any(_value_is_dist(v) for v in kwargs.values()):
        return True
    inst = getattr(sf, "_class_instance", None)
    inst = inst() if callable(inst) else inst
    if inst is not None and _value_is_dist(inst):
        return True
    return any(_value_is_dist(v) for v in _referenced(getattr(sf, "_dygraph_function", None)))


def check_static_call(op: str) -> None:
    """Called by dispatch on a routed op over distributed tensors: refuse paddle's static-graph mode."""
    import paddle

    if not paddle.in_dynamic_mode():
        raise NotImplementedError(f"{op} received distributed tensors while paddle builds a static program "
                                  f"(paddle.jit.to_static): their layouts cannot be lowered into it. Decorate a "
                                  f"function that names the model or its inputs directly (it then runs through "
                                  f"autoparallel's dispatch), or use ap.to_static(model, loader, loss_fn, "
                                  f"optimizer)")
