"""The tensor call forms that are not a plain op call: in-place ``op_`` forms, ``x[index] = value``, cast
spellings, ``paddle.is_tensor``, ``new_*``, and in-place updates of a plain buffer by distributed operands
(the buffer is shadowed by the distributed result). See docs/dispatch_real_models.md.
"""
from __future__ import annotations

import paddle
from paddle.base.framework import EagerParamBase

from autoparallel import aliases
from autoparallel import dispatch as D
from autoparallel.dist_tensor import DistParameter, DistTensor, as_dist
from autoparallel.local_mode import _state as _local_state
from autoparallel.local_mode import local_mode
from autoparallel.spec import normalize_dtype


def inplace_routed(op, path, orig):
    """``op_``: the out-of-place rule and local op of ``path``, then the target rebinds to the result."""
    def wrapper(*args, **kwargs):
        if getattr(_local_state, "depth", 0) > 0 or not D._any_dist(args, kwargs):
            return orig(*args, **kwargs)
        target = args[0] if args else next(iter(kwargs.values()))
        return rebind(path, target, D.run(op, path, args, kwargs))

    wrapper.__wrapped__ = orig
    wrapper.__name__ = getattr(orig, "__name__", path.rsplit(".", 1)[-1] + "_")
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper._ap_inplace = op
    wrapper._ap_path = path
    wrapper._ap_wrapper = True
    return wrapper


def rebind(path, target, out):
    if type(target) is DistTensor:
        target._locals, target._spec = out._locals, out._spec
        return target
    if isinstance(target, DistParameter) and hasattr(target, "_ap_spec"):
        if out.spec != target._ap_spec and out.spec.shape == target._ap_spec.shape \
                and out.spec.dtype == target._ap_spec.dtype:
            from autoparallel.dist_tensor import reshard

            out = reshard(out, target._ap_spec.mesh, target._ap_spec.placements)
        if out.spec != target._ap_spec:
            raise NotImplementedError(f"{path}_ would change the distributed parameter {target.name} from "
                                      f"{D._specs_str([target._ap_spec])} to {D._specs_str([out.spec])}; in place, a "
                                      f"parameter keeps its layout: use the out-of-place {path}")
        if not target.stop_gradient and paddle.is_grad_enabled():
            raise ValueError(f"{path}_: the leaf parameter {target.name} requires a gradient, so it cannot be "
                             f"changed in place (as paddle refuses); wrap the update in paddle.no_grad()")
        with local_mode(), paddle.no_grad():
            for r, t in target._ap_locals.items():
                paddle.assign(out._locals[r], output=t)
        return target
    if isinstance(target, paddle.Tensor) and not isinstance(target, EagerParamBase):
        # a plain tensor (replicated by convention) updated in place with distributed operands, e.g. a
        # zeros buffer the model index_add_s expert outputs into: the tensor object is shadowed by the
        # distributed result, which every later routed op reading it uses instead
        target._ap_shadow = out
        if not SHADOWS[0]:
            SHADOWS[0] = True
            _install_shadow_readers()
        return out
    raise TypeError(f"{path}_: the in-place target is a {type(target).__name__}, which cannot hold a "
                    f"distributed result; use the out-of-place {path}")


SHADOWS = [False]        # set once some plain tensor was updated in place by a distributed result


def _install_shadow_readers() -> None:
    """A shadowed plain tensor read directly (``numpy()``, ``item()``, ``tolist()``) gives the distributed
    value, not the stale buffer."""
    for name in ("numpy", "item", "tolist"):
        orig = getattr(paddle.Tensor, name)

        def reader(self, *args, __orig=orig, __name=name, **kwargs):
            sh = getattr(self, "_ap_shadow", None) if self.__class__ is paddle.Tensor else None
            if sh is None:
                return __orig(self, *args, **kwargs)
            return getattr(sh, __name)(*args, **kwargs) if __name != "tolist" else sh.numpy().tolist()

        setattr(paddle.Tensor, name, _mark(reader, orig, name))


def _shadow_of(v):
    return getattr(v, "_ap_shadow", None) if v.__class__ is paddle.Tensor else None


def _has_shadow(args, kwargs) -> bool:
    for v in list(args) + list(kwargs.values()):
        if _shadow_of(v) is not None or (type(v) in (list, tuple) and any(_shadow_of(u) is not None for u in v)):
            return True
    return False


def _unshadow(args, kwargs):
    def sub(v):
        if type(v) in (list, tuple):
            return type(v)(sub(u) for u in v)
        sh = _shadow_of(v)
        return v if sh is None else sh

    return tuple(sub(a) for a in args), {k: sub(v) for k, v in kwargs.items()}


def install_setitem() -> None:
    """``x[index] = value`` with a distributed x, index or value: the setitem rule, then x rebinds."""
    path = "paddle.Tensor.__setitem__"
    orig = paddle.Tensor.__setitem__
    if getattr(orig, "_ap_wrapper", False):
        return
    D._ORIG[path] = orig
    w = inplace_routed("setitem", path, orig)

    def setitem(self, index, value):
        w(self, index, value)

    _mark(setitem, orig, "__setitem__")
    paddle.Tensor.__setitem__ = setitem

    def dist_setitem(self, index, value):
        rebind(path, self, D.run("setitem", path, (self, index, value), {}))

    DistTensor.__setitem__ = dist_setitem


def install_casts() -> None:
    """Cast spellings on paddle.Tensor (DistParameter) and DistTensor, through the cast rule."""
    def conversion(name):
        orig = getattr(paddle.Tensor, name)

        def method(self, *args, **kwargs):
            if not D.is_dist(self) or getattr(_local_state, "depth", 0) > 0:
                return orig(self, *args, **kwargs)
            return D.run("cast", "paddle.cast", (self, aliases.conversion_dtype(name, _dtype_of(self))), {})
        return _mark(method, orig, name)

    def type_as(self, other):
        if not D.is_dist(self) or getattr(_local_state, "depth", 0) > 0:
            return aliases.original(paddle.Tensor.type_as)(self, other)
        return D.run("cast", "paddle.cast", (self, _dtype_of(other)), {})

    def to(self, *args, **kwargs):
        if not (D._any_dist((self,) + args, kwargs)) or getattr(_local_state, "depth", 0) > 0:
            return aliases.original(paddle.Tensor.to)(self, *args, **kwargs)
        dtype = aliases.to_dtype(_dtype_of(self), args, kwargs)
        if normalize_dtype(dtype) == normalize_dtype(_dtype_of(self)):
            return self
        return D.run("cast", "paddle.cast", (self, dtype), {})

    for name in aliases._CONVERSIONS:
        if hasattr(paddle.Tensor, name) and not getattr(getattr(paddle.Tensor, name), "_ap_wrapper", False):
            _set_both(name, conversion(name))
    for name, fn in (("type_as", type_as), ("to", to)):
        if not getattr(getattr(paddle.Tensor, name), "_ap_wrapper", False):
            _set_both(name, _mark(fn, getattr(paddle.Tensor, name), name))


def _dtype_of(x):
    return as_dist(x).dtype if D.is_dist(x) else x.dtype


def _mark(fn, orig, name):
    fn.__wrapped__ = orig
    fn.__name__ = name
    fn.__doc__ = getattr(orig, "__doc__", None)
    fn._ap_wrapper = True
    fn._ap_cast = True
    return fn


def _set_both(name, fn):
    setattr(paddle.Tensor, name, fn)
    setattr(DistTensor, name, fn)


def install_metadata() -> None:
    """``paddle.is_tensor`` is true for a DistTensor (see dist_tensor.py for what it answers locally)."""
    orig = paddle.is_tensor
    if getattr(orig, "_ap_wrapper", False):
        return

    def is_tensor(x):
        return type(x) is DistTensor or orig(x)

    _mark(is_tensor, orig, "is_tensor")
    aliases.repoint_modules({id(orig): is_tensor})        # paddle.is_tensor, paddle.tensor.logic... and importers


def new_like(name):
    """``x.new_zeros(...)`` & co.: a new plain tensor (replicated) with x's dtype, as paddle makes it."""
    orig = getattr(paddle.Tensor, name)

    def method(self, *args, **kwargs):
        return orig(paddle.zeros([], dtype=self.dtype), *args, **kwargs)

    method.__name__ = name
    return method
