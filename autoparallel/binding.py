"""Bind a call of a paddle op the way paddle itself binds it, into one canonical form.

Paddle 3.x accepts many spellings of one call: ``x.reshape(b, h, s, d)`` and ``x.reshape([b, h, s, d])``,
torch-style ``x.transpose(1, 2)`` for ``perm=[0, 2, 1, 3]``, ``dim=`` for ``axis=``, ``input=`` for ``x=``,
``size=`` for ``shape=`` ... Each spelling is handled by a decorator on the python function
(``paddle/utils/decorator_utils.py``: ``ParamAliasDecorator``, ``param_one_alias``, ``reshape_decorator``,
``transpose_decorator``, ``size_args_decorator`` ...), each a wrapper ``wrapper(*args, **kwargs)`` that
rewrites the arguments and calls the next function, which it holds in its closure.

``canonical(fn, args, kwargs)`` runs paddle's OWN wrappers of ``fn`` with the innermost function replaced
by a recorder: whatever the wrappers hand on is what the real function would have received. That is then
bound to the innermost function's ``inspect.signature``: positional parameters positionally (as far as
they are given without a gap), the rest by keyword. A new paddle version with new aliases or call forms
needs no edit here: the new wrappers run as they are.

Wrappers only read their arguments' python types and ``.ndim`` (``transpose_decorator``), both of which a
DistTensor answers without communication (its ``ndim`` is the global rank).
"""
from __future__ import annotations

import inspect
import types


class _Captured(BaseException):
    """Raised by the recorder; a BaseException so no ``except Exception`` in a wrapper swallows it."""

    def __init__(self, args, kwargs):
        super().__init__()
        self.call = (args, kwargs)


def _record(*args, **kwargs):
    raise _Captured(args, dict(kwargs))


class Binder:
    """The canonical binding of one paddle callable (built once per callable)."""

    __slots__ = ("inner", "sig", "front", "identity", "parsed_in_c", "layout")

    def __init__(self, fn):
        self.front, self.inner = _rebuild(fn)
        self.sig = _signature(self.inner)
        self.parsed_in_c = _parsed_in_c(self.inner)
        self.layout = _Layout(self.sig) if self.sig is not None else None
        self.identity = set()        # call shapes (argument kinds, keyword names) already canonical: skipped

    def __call__(self, args, kwargs):
        """``(args, kwargs)`` in canonical form; raises TypeError as paddle would for a call that does not bind."""
        shape = (tuple(map(_kind, args)), tuple((k, _kind(v)) for k, v in kwargs.items())) \
            if len(args) < 8 else None
        if shape is not None and shape in self.identity:
            return args, kwargs
        a, k = args, kwargs
        if self.front is not None:
            try:
                self.front(*args, **dict(kwargs))
            except _Captured as c:
                a, k = c.call
            else:               # the wrapper returned without calling on (it handled the call itself)
                return args, kwargs
        if self.sig is None:
            return a, k
        if self.parsed_in_c:
            a, k = _c_parser_forms(self.sig, a, k, _C_OP_ALIASES.get(self.inner.__name__, {}))
        out = self.layout.bind(a, k)
        if shape is not None and _same(out, args, kwargs):
            self.identity.add(shape)
        return out


class _Layout:
    """``inspect.Signature.bind`` for the canonical form, without its per-call overhead: positional
    parameters positionally up to the first one not given, the rest (and keyword-only ones) by keyword."""

    __slots__ = ("sig", "pos", "index", "var_pos", "kw_only", "var_kw")

    def __init__(self, sig):
        P = inspect.Parameter
        params = list(sig.parameters.values())
        self.sig = sig
        self.pos = [p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        self.index = {n: i for i, n in enumerate(self.pos)
                      if sig.parameters[n].kind is not P.POSITIONAL_ONLY}
        self.var_pos = any(p.kind is P.VAR_POSITIONAL for p in params)
        self.kw_only = {p.name for p in params if p.kind is P.KEYWORD_ONLY}
        self.var_kw = any(p.kind is P.VAR_KEYWORD for p in params)

    def bind(self, args, kwargs):
        n = len(self.pos)
        if len(args) > n and not self.var_pos:
            raise TypeError(f"takes {n} positional arguments but {len(args)} were given")
        if not kwargs:
            return tuple(args), {}
        slots = list(args[:n]) + [_MISSING] * max(0, n - len(args))
        extra = {}
        for k, v in kwargs.items():
            i = self.index.get(k)
            if i is not None:
                if slots[i] is not _MISSING:
                    raise TypeError(f"got multiple values for argument {k!r}")
                slots[i] = v
            elif k in self.kw_only or self.var_kw:
                extra[k] = v
            else:
                raise TypeError(f"got an unexpected keyword argument {k!r}")
        first_gap = next((i for i, v in enumerate(slots) if v is _MISSING), n)
        out_args = tuple(slots[:first_gap]) + (tuple(args[n:]) if first_gap == n else ())
        rest = {self.pos[i]: v for i, v in enumerate(slots[first_gap:], first_gap) if v is not _MISSING}
        if rest:
            extra = {**rest, **extra}
        return out_args, extra


_MISSING = object()


def _kind(v):
    """What paddle's wrappers branch on: the python type, and a tensor's rank (``reshape_decorator`` treats
    a 0-d tensor as one size of a varargs shape)."""
    t = type(v)
    nd = getattr(v, "ndim", None) if t not in _ATOMS else None
    return t if nd is None else (t, nd)


_ATOMS = frozenset({int, float, bool, str, type(None), list, tuple, slice})


def _same(out, args, kwargs) -> bool:
    """The canonical call is the given one, object for object (identity only: ``==`` on tensors is an op)."""
    oa, ok = out
    return len(oa) == len(args) and all(x is y for x, y in zip(oa, args)) and ok.keys() == kwargs.keys() \
        and all(ok[n] is kwargs[n] for n in kwargs)


# Functions paddle generates as ``def _sum(*args, **kwargs): return _C_ops.sum(*args, **kwargs)`` (with the
# documented ``__signature__``) bind in C++, which accepts paddle's torch-compatible keyword aliases (the
# same ones its python decorators map) and, like ``sum_decorator``, a bool where ``dtype`` stands for ``keepdim``.
_C_ALIASES = {"input": "x", "other": "y", "dim": "axis"}
# aliases paddle 3.3's C++ parser accepts for one op only (measured: ``paddle.roll(x, 1, dims=0)`` runs,
# ``paddle.sum(x, dims=0)`` is refused), keyed by the generated function's name
_C_OP_ALIASES = {"_roll": {"dims": "axis"}, "_argmax": {"keepdims": "keepdim"}, "_argmin": {"keepdims": "keepdim"}}


def _parsed_in_c(fn) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_flags & inspect.CO_VARARGS and code.co_flags & inspect.CO_VARKEYWORDS \
        and code.co_argcount == 0 and "_C_ops" in code.co_names and hasattr(fn, "__signature__")


def _c_parser_forms(sig, args, kwargs, op_aliases=None):
    params = sig.parameters
    if any(k not in params for k in kwargs):
        kwargs = dict(kwargs)
        for alias, name in {**_C_ALIASES, **(op_aliases or {})}.items():
            if alias in kwargs and alias not in params and name in params:
                if name in kwargs:
                    raise TypeError(f"got both {name!r} and its alias {alias!r}")
                kwargs[name] = kwargs.pop(alias)
    names = list(params)
    if "dtype" in names and "keepdim" in names and "keepdim" not in kwargs:
        i = names.index("dtype")
        if len(args) > i and isinstance(args[i], bool) and names.index("keepdim") > i:
            kwargs = {**kwargs, "keepdim": args[i]}
            extra = args[i + 1:]
            args = args[:i]
            if extra:        # (x, axis, keepdim, dtype)
                kwargs["dtype"] = extra[0]
    return args, kwargs


def _signature(fn):
    if _chooses_overload(fn):
        return None
    try:
        return inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):
        return None


def _chooses_overload(fn) -> bool:
    """Paddle's python overloads (``paddle.gather``/``scatter``: ``def gather(*args, **kwargs)`` picking the
    torch form ``(input, dim, index)`` or paddle's ``(x, index, axis)`` by the arguments' types): their
    ``__signature__`` documents one form only, so the call is passed on as given and their rules bind it."""
    code = getattr(inspect.unwrap(fn), "__code__", None) if isinstance(fn, types.FunctionType) else None
    return code is not None and code.co_argcount == 0 and bool(code.co_flags & inspect.CO_VARARGS) \
        and bool(code.co_flags & inspect.CO_VARKEYWORDS) and "_C_ops" not in code.co_names \
        and not code.co_freevars and any(n.endswith("_wrapper") for n in code.co_names)


def _rebuild(fn):
    """(front, inner): ``front`` is a copy of ``fn``'s chain of argument-rewriting wrappers whose innermost
    call records its arguments instead (None when ``fn`` has no wrappers), ``inner`` the function that
    call would have reached. A wrapper reaches the next function through its closure, directly
    (``functools.wraps`` style) or through a helper's closure (the ``decorator`` package's style); the
    deepest function of the ``__wrapped__`` chain that can be reached that way is the inner one."""
    chain = []
    f = fn
    while getattr(f, "__wrapped__", None) is not None and len(chain) < 16:
        f = f.__wrapped__
        chain.append(f)
    for target in reversed(chain):
        front = _rewire(fn, target, 0)
        if front is not None:
            return front, target
    return None, fn


def _rewire(f, target, depth):
    """A copy of ``f`` whose path through closures to ``target`` ends at the recorder, or None."""
    if not isinstance(f, types.FunctionType) or not f.__closure__ or depth > 4:
        return None
    for i, cell in enumerate(f.__closure__):
        try:
            c = cell.cell_contents
        except ValueError:
            continue
        if c is target:
            return _clone(f, i, _record)
        if isinstance(c, types.FunctionType):
            inner = _rewire(c, target, depth + 1)
            if inner is not None:
                return _clone(f, i, inner)
    return None


def _clone(f, index, replacement):
    cells = list(f.__closure__)
    cells[index] = types.CellType(replacement)
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, tuple(cells))
    g.__kwdefaults__ = f.__kwdefaults__
    return g


_BINDERS: dict = {}


def binder(fn) -> Binder:
    """The Binder of ``fn`` (cached; the function is kept alive with it so its id stays its own)."""
    hit = _BINDERS.get(id(fn))
    if hit is None or hit[0] is not fn:
        hit = _BINDERS[id(fn)] = (fn, Binder(fn))
    return hit[1]


def canonical(fn, args, kwargs):
    """``fn(*args, **kwargs)`` as the canonical ``(args, kwargs)`` of ``fn``'s innermost signature."""
    return binder(fn)(tuple(args), dict(kwargs))


def has_signature(fn) -> bool:
    """True when ``fn`` is a python callable with a signature (operators and ``_C_ops`` have none)."""
    return isinstance(fn, types.FunctionType) and _signature(fn) is not None
