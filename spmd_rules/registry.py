"""The rule registry: ``register_spmd_rule``, ``get_spmd_rule`` and the validating wrapper around rules."""
from __future__ import annotations

import inspect
from typing import Callable, Iterable

from autoparallel.core.placement import Placement, parse_placements
from autoparallel.core.spec import DistSpec

from spmd_rules.blocks import has_blocks, is_block_aware, unblock
from spmd_rules.result import LocalShaped, SpmdResult

_RULES: dict = {}
_CACHE_LIMIT = 8192


class NoSpmdRuleError(NotImplementedError, KeyError):
    """No rule is registered for an op (both a NotImplementedError and a KeyError)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# ---- walking the arguments of a call ------------------------------------------------------------------
def _is_spec(v) -> bool:
    return isinstance(v, DistSpec)


def flatten_specs(args, kwargs=None, is_leaf: Callable = _is_spec) -> list:
    """Leaves of a call in the order rules report them: positional args first, then kwargs in call order;
    lists and tuples are entered recursively. The runtime uses the same walk with its own ``is_leaf``."""
    out: list = []

    def walk(v):
        if is_leaf(v):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    for a in args:
        walk(a)
    for v in (kwargs or {}).values():
        walk(v)
    return out


def replace_specs(args, kwargs, new: Iterable, is_leaf: Callable = _is_spec):
    """``(args, kwargs)`` with their leaves replaced, in ``flatten_specs`` order, by the items of ``new``."""
    it = iter(new)

    def walk(v):
        if is_leaf(v):
            return next(it)
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple):
            return tuple(walk(x) for x in v)
        return v

    new_args = tuple(walk(a) for a in args)
    new_kwargs = {k: walk(v) for k, v in (kwargs or {}).items()}
    return new_args, new_kwargs


def _call_order(sig, args, kwargs, skip: int = 0) -> list | None:
    """Permutation from the rule's own order of DistSpec leaves (its signature order) to the call's order.

    Returns ``order`` with ``order[c]`` = call-order index of the c-th leaf in signature order, or None
    when both orders agree. Raises TypeError when the call does not bind to the rule's signature."""
    if sig is None:
        return None
    params = list(sig.parameters.values())[skip:]
    index = {p.name: i for i, p in enumerate(params)}
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
    var_kw = next((p.name for p in params if p.kind == p.VAR_KEYWORD), None)
    keys: list = []

    def walk(v, key):
        if isinstance(v, DistSpec):
            keys.append(key)
        elif isinstance(v, (list, tuple)):
            for j, x in enumerate(v):
                walk(x, key + (j,))

    for i, a in enumerate(args):
        if i < len(positional):
            walk(a, (index[positional[i]],))
        elif var_pos is not None:
            walk(a, (index[var_pos], i - len(positional)))
        else:
            raise TypeError(f"takes {len(positional)} positional arguments but {len(args)} were given")
    for n, (k, v) in enumerate(kwargs.items()):
        p = sig.parameters.get(k)
        if p is not None and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and k in index:
            walk(v, (index[k],))
        elif var_kw is not None:
            walk(v, (index[var_kw], n))
        else:
            raise TypeError(f"got an unexpected keyword argument {k!r}")
    order = sorted(range(len(keys)), key=lambda j: keys[j])
    return None if order == list(range(len(keys))) else order


def _signature(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def call_key(args, kwargs) -> tuple:
    """A hashable key of a rule call's arguments (kwargs keep their call order: it decides the order of
    ``inputs``); raises TypeError when an argument has none."""
    return _freeze(args), tuple((k, _freeze(v)) for k, v in kwargs.items())


def _freeze(v):
    """A hashable key for a call argument (raises TypeError when there is none)."""
    if isinstance(v, DistSpec):
        return v
    if isinstance(v, (list, tuple)):
        return (type(v).__name__,) + tuple(_freeze(x) for x in v)
    if isinstance(v, slice):
        return ("slice", _freeze(v.start), _freeze(v.stop), _freeze(v.step))
    if isinstance(v, dict):
        return ("dict",) + tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    hash(v)
    return (type(v).__name__, v)


# ---- validation of what a rule returns ------------------------------------------------------------------
def _coerce_input(op: str, i: int, given: DistSpec, req) -> DistSpec:
    if isinstance(req, DistSpec):
        spec = req
    elif isinstance(req, (str, list, tuple)):
        try:
            spec = given.with_placements(parse_placements(req))
        except (TypeError, ValueError) as e:
            raise ValueError(f"spmd rule {op!r}: required placements {req!r} for input {i} "
                             f"(shape {list(given.shape)}) are invalid: {e}") from None
    else:
        raise TypeError(f"spmd rule {op!r}: required input {i} must be a DistSpec or a placements list, "
                        f"got {type(req).__name__} {req!r}")
    if spec.shape != given.shape or spec.dtype != given.dtype:
        raise ValueError(f"spmd rule {op!r}: required spec for input {i} has shape {list(spec.shape)} "
                         f"{spec.dtype}, but the argument has shape {list(given.shape)} {given.dtype}; "
                         f"a rule may only change placements")
    if spec.mesh != given.mesh:
        raise ValueError(f"spmd rule {op!r}: required spec for input {i} is on mesh {spec.mesh!r}, "
                         f"but the argument is on {given.mesh!r}; a rule may only change placements")
    return spec


def _validate(op: str, given: list, result, *, n_outputs: int | None = None, order=None) -> SpmdResult:
    """Check a rule's result against the call's DistSpec arguments ``given`` (call order); ``order`` maps
    the rule's own input order to the call order (None: identical)."""
    if order is not None:
        given_rule = [given[j] for j in order]
    else:
        given_rule = given
    if not isinstance(result, SpmdResult):
        raise TypeError(f"spmd rule {op!r} must return an SpmdResult(inputs, outputs), "
                        f"got {type(result).__name__}")
    if len(result.inputs) != len(given):
        raise TypeError(f"spmd rule {op!r} returned {len(result.inputs)} required input specs, expected "
                        f"{len(given)} (one per DistSpec argument)")
    inputs = [_coerce_input(op, i, g, r) for i, (g, r) in enumerate(zip(given_rule, result.inputs))]
    if order is not None:
        call_order = [None] * len(inputs)
        for c, j in enumerate(order):
            call_order[j] = inputs[c]
        inputs = call_order
    inputs = tuple(inputs)
    if not result.outputs:
        raise TypeError(f"spmd rule {op!r} returned no output specs")
    if n_outputs is not None and len(result.outputs) != n_outputs:
        raise TypeError(f"spmd rule {op!r} returned {len(result.outputs)} output specs, expected {n_outputs}")
    mesh = given[0].mesh if given else None
    for k, out in enumerate(result.outputs):
        if out is None or isinstance(out, LocalShaped):
            continue
        if not isinstance(out, DistSpec):
            raise TypeError(f"spmd rule {op!r}: output {k} must be a DistSpec (or None for an absent "
                            f"output), got {type(out).__name__} {out!r}")
        for p in out.placements:
            if not isinstance(p, Placement):
                raise ValueError(f"spmd rule {op!r}: output {k} has an invalid placement {p!r}")
        if mesh is not None and out.mesh != mesh:
            raise ValueError(f"spmd rule {op!r}: output {k} is on mesh {out.mesh!r} but the inputs are on "
                             f"{mesh!r}")
    if result.local_op is not None and not isinstance(result.local_op, str):
        raise TypeError(f"spmd rule {op!r}: local_op must be a name (str) or None, got {result.local_op!r}")
    if result.local_attrs is not None and not callable(result.local_attrs):
        raise TypeError(f"spmd rule {op!r}: local_attrs must be a callable (coords) -> dict or None")
    return SpmdResult(inputs, result.outputs, result.local_op, result.local_attrs, op)


def _named(op: str, e: Exception) -> Exception:
    """The same error with the op name in front (unchanged when it already starts with it)."""
    msg = str(e)
    if msg.startswith(f"{op}:") or msg.startswith(f"spmd rule {op!r}"):
        return e
    try:
        return type(e)(f"{op}: {msg}")
    except Exception:
        return e


# ---- the registered rule ----------------------------------------------------------------------------------
class SpmdRule:
    """A registered rule: call it like the paddle op, with DistSpecs in place of tensors."""

    def __init__(self, name: str, fn: Callable, reverse: Callable | None = None):
        self.name = name
        self.fn = fn
        self.reverse_fn = reverse
        self._sig = _signature(fn)
        self._rsig = _signature(reverse) if reverse is not None else None
        self._cache: dict = {}

    def __call__(self, *args, **kwargs) -> SpmdResult:
        try:
            key = call_key(args, kwargs)
        except TypeError:
            key = None
        if key is not None and key in self._cache:
            return self._cache[key]
        given = flatten_specs(args, kwargs)
        blocked = has_blocks(given)
        if blocked and not is_block_aware(self.fn):     # the rule sees block-sharded inputs as R
            args, kwargs = replace_specs(args, kwargs, [unblock(s) for s in given])
        try:
            order = _call_order(self._sig, args, kwargs)
            try:
                result = self.fn(*args, **kwargs)
            except ValueError:                  # e.g. a block-split label meeting a plain split of it: gather
                if not blocked or not is_block_aware(self.fn):
                    raise
                plain_args, plain_kwargs = replace_specs(args, kwargs, [unblock(s) for s in given])
                result = self.fn(*plain_args, **plain_kwargs)
        except (ValueError, TypeError, IndexError, NotImplementedError) as e:
            err = _named(self.name, e)
            if err is e:
                raise
            raise err from e
        result = _validate(self.name, given, result, order=order)
        if key is not None:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[key] = result
        return result

    def local_call(self, result: SpmdResult, args, kwargs, coords):
        """``(args, kwargs)`` for the local call on the rank at ``coords``: the call's arguments (with local
        tensors in place of DistSpecs) updated by ``result.local_kwargs(coords)``. An override replaces the
        argument of that parameter name wherever it was passed (positionally or by keyword); names the
        signature lacks (extra attributes of a ``local_op``) are added as keywords."""
        by_pos, by_kw = self.local_overrides(result, len(args), coords)
        if not by_pos and not by_kw:
            return tuple(args), dict(kwargs)
        args, kwargs = list(args), dict(kwargs)
        for i, value in by_pos:
            args[i] = value
        kwargs.update(by_kw)
        return tuple(args), kwargs

    def local_overrides(self, result: SpmdResult, n_args: int, coords):
        """``result.local_kwargs(coords)`` split for a call with ``n_args`` positional arguments:
        ``((index, value), ...)`` replacing positional arguments and ``{name: value}`` keywords."""
        overrides = result.local_kwargs(coords)
        if not overrides:
            return (), {}
        positional = []
        if self._sig is not None:
            positional = [p.name for p in self._sig.parameters.values()
                          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        by_pos, by_kw = [], {}
        for name, value in overrides.items():
            if name in positional and positional.index(name) < n_args:
                by_pos.append((positional.index(name), value))
            else:
                by_kw[name] = value
        return tuple(by_pos), by_kw

    @property
    def has_reverse(self) -> bool:
        return self.reverse_fn is not None

    def reverse(self, outputs, *args, **kwargs) -> SpmdResult:
        """Input specs implied by wanted output specs (used by whole-graph completion).

        ``outputs`` is the sequence of wanted output DistSpecs; ``args``/``kwargs`` mirror the forward call
        (the input specs give shapes and dtypes; their placements are only hints)."""
        if self.reverse_fn is None:
            raise NotImplementedError(f"spmd rule {self.name!r} has no reverse form; register one with "
                                      f"register_spmd_rule({self.name!r}, reverse=fn)")
        outputs = tuple(outputs) if isinstance(outputs, (list, tuple)) else (outputs,)
        given = flatten_specs(args, kwargs)
        try:
            order = _call_order(self._rsig, args, kwargs, skip=1)
            result = self.reverse_fn(outputs, *args, **kwargs)
        except (ValueError, TypeError, IndexError, NotImplementedError) as e:
            err = _named(self.name, e)
            if err is e:
                raise
            raise err from e
        return _validate(self.name, given, result, n_outputs=len(outputs), order=order)

    def __repr__(self) -> str:
        return f"SpmdRule({self.name!r}, {getattr(self.fn, '__qualname__', self.fn)})"


def register_spmd_rule(names, fn: Callable | None = None, *, reverse: Callable | None = None):
    """Register ``fn`` as the forward rule of one op name or a list of names; usable as a decorator.

    Registering a name that already has a rule REPLACES it (users may override built-in rules); the
    decorator returns ``fn`` unchanged. ``reverse`` is the optional reverse form
    ``reverse(output_specs, *args, **kwargs) -> SpmdResult``. A rule with the parameters
    ``(inputs, outputs, attrs, mesh)`` returning ``{"inputs": {...}, "outputs": {...}}`` placements is the
    dict form (dict_rules.py), adapted onto the registry.
    """
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, (list, tuple, set, frozenset)):
        raise TypeError(f"register_spmd_rule expects an op name or a list of op names, got {type(names).__name__} "
                        f"{names!r:.60}; use it as @register_spmd_rule('my_op')")
    names = list(names)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"register_spmd_rule expects an op name or a list of op names, got {names!r}")

    def deco(f: Callable) -> Callable:
        if not callable(f):
            raise TypeError(f"register_spmd_rule({names!r}) expects a callable rule, got {f!r}")
        if reverse is not None and not callable(reverse):
            raise TypeError(f"register_spmd_rule({names!r}): reverse must be callable, got {reverse!r}")
        from spmd_rules import dict_rules

        for n in names:
            if dict_rules.is_dict_rule(f):          # the article's (inputs, outputs, attrs, mesh) -> dict form
                prior = _RULES.get(n)
                prior = getattr(prior, "shape_rule", prior)  # re-registering keeps the built-in shape function
                rule = SpmdRule(n, dict_rules.adapt(n, f, prior), reverse)
                rule.shape_rule = prior
                _RULES[n] = rule
            else:
                _RULES[n] = SpmdRule(n, f, reverse)
        return f

    return deco(fn) if fn is not None else deco


def unregister_spmd_rule(name: str) -> None:
    """Remove a rule (no error when absent)."""
    _RULES.pop(name, None)


def get_spmd_rule(name: str) -> SpmdRule:
    if name not in _RULES:
        raise NoSpmdRuleError(f"no spmd rule for op {name!r}: register one with "
                              f"@register_spmd_rule({name!r}) (see spmd_rules/__init__.py)")
    return _RULES[name]


def has_spmd_rule(name: str) -> bool:
    return name in _RULES


def registered_ops() -> list:
    return sorted(_RULES)
