"""The tensor call forms that are not a plain op call: in-place ``op_`` forms, ``x[index] = value``, cast
spellings, ``paddle.is_tensor``, ``new_*``, and in-place updates of a plain buffer by distributed operands
(the buffer is shadowed by the distributed result). See docs/dispatch_real_models.md.
"""
from __future__ import annotations

import inspect

import paddle

from autoparallel import aliases, patches, shadows, view_alias
from autoparallel.compat import EagerParamBase
from autoparallel import dispatch as D
from autoparallel.dispatch_handle import inplace_target
from autoparallel.dist_tensor import DistParameter, DistTensor, as_dist
from autoparallel.dist_tensor_forms import detach_base, live_aliases
from autoparallel.context import state as _ctx
from autoparallel.local_mode import local_mode
from autoparallel.spec import normalize_dtype
from spmd_rules.op_table import IN_PLACE_PATHS


def inplace_routed(op, path, orig):
    """``op_``: the out-of-place rule and local op of ``path``, then the target rebinds to the result."""
    def wrapper(*args, **kwargs):
        if _ctx.local_depth > 0 or not D._any_dist(args, kwargs):
            return orig(*args, **kwargs)
        return rebind(path, inplace_target(op, orig, args, kwargs), D.run(op, path, args, kwargs))

    wrapper.__wrapped__ = orig
    wrapper.__name__ = getattr(orig, "__name__", path.rsplit(".", 1)[-1] + "_")
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper._ap_inplace = op
    wrapper._ap_path = path
    wrapper._ap_wrapper = True
    return wrapper


def _named(path) -> str:
    """The in-place form's name of a routed path: ``paddle.add`` -> ``paddle.add_``; a path that is itself paddle's
    in-place form (``op_table.IN_PLACE_PATHS``) as it is."""
    return path if path in IN_PLACE_PATHS else path + "_"


def _out_of_place(path) -> str:
    """How to get the result without writing in place, for an error message."""
    if path in IN_PLACE_PATHS:
        return f"{path} on a copy (x.clone())"
    return f"the out-of-place {path}"


def _check_leaf(path, target) -> None:
    """paddle refuses an in-place op on a leaf tensor that requires a gradient while gradients are recorded."""
    if not paddle.is_grad_enabled() or not D._any_dist((target,), {}) or target.stop_gradient:
        return
    if isinstance(target, DistParameter) or target.is_leaf:
        raise ValueError(f"{_named(path)}: a leaf tensor that requires a gradient (stop_gradient=False) cannot be "
                         f"changed in place while gradients are recorded (paddle refuses it too); do it under "
                         f"paddle.no_grad(), or use {_out_of_place(path)}")


def rebind(path, target, out):
    _check_leaf(path, target)
    if type(target) is DistTensor:
        into_storage = detach_base(target) is not None or not (paddle.is_grad_enabled() or target.stop_gradient)
        if not (into_storage and _write_values(target, out)):
            target._locals, target._spec = out._locals, out._spec
            _share_with_aliases(target)
        view_alias.written(path, target)
        return target
    if isinstance(target, DistParameter) and hasattr(target, "_ap_spec"):
        if out.spec != target._ap_spec and out.spec.shape == target._ap_spec.shape \
                and out.spec.dtype == target._ap_spec.dtype:
            from autoparallel.dist_tensor import reshard

            out = reshard(out, target._ap_spec.mesh, target._ap_spec.placements)
        if out.spec != target._ap_spec:
            raise NotImplementedError(f"{_named(path)} would change the distributed parameter {target.name} from "
                                      f"{D._specs_str([target._ap_spec])} to {D._specs_str([out.spec])}; in place, a "
                                      f"parameter keeps its layout: use {_out_of_place(path)}")
        if not target.stop_gradient and paddle.is_grad_enabled():
            raise ValueError(f"{_named(path)}: the leaf parameter {target.name} requires a gradient, so it cannot "
                             f"be changed in place (as paddle refuses); wrap the update in paddle.no_grad()")
        from autoparallel.dist_tensor_forms import _writing

        with _writing(target), local_mode(), paddle.no_grad():     # a ZeRO parameter's master chunks follow
            for r, t in target._ap_locals.items():
                paddle.assign(out._locals[r], output=t)
        view_alias.written(path, target)            # its live views now hold stale values
        return target
    if isinstance(target, paddle.Tensor) and not isinstance(target, EagerParamBase):
        # a plain tensor (replicated by convention) updated in place with distributed operands, e.g. a
        # zeros buffer the model index_add_s expert outputs into: the tensor object is shadowed by the
        # distributed result, which every later routed op reading it uses instead
        if shadows.shadow(target, out):
            install_shadow_readers()
        return out
    raise TypeError(f"{_named(path)}: the in-place target is a {type(target).__name__}, which cannot hold a "
                    f"distributed result; use {_out_of_place(path)}")


def _share_with_aliases(target) -> None:
    """paddle's ``e = t.detach()`` shares ``t``'s storage: after ``t`` took new shards in place, ``e`` reads them
    too (a write through ``e`` goes into the shards it shares: ``_write_values``)."""
    for alias in live_aliases(target):
        alias._locals = {r: t.detach() for r, t in target._locals.items()}
        alias._spec = target._spec


def _write_values(target, out) -> bool:
    """paddle's in-place op under ``no_grad`` on a tensor that requires a gradient: the values change and the
    tensor keeps its place in the graph (a leaf stays a leaf whose gradient accumulates, a non-leaf keeps its
    gradient function); swapping in the result's shards, made without a gradient, lost both. False when the
    result cannot be written into the tensor's shards (another global shape or dtype)."""
    if out.spec.shape != target.spec.shape or out.spec.dtype != target.spec.dtype:
        return False
    if out.spec != target.spec:
        from autoparallel.dist_tensor import reshard

        out = reshard(out, target.spec.mesh, target.spec.placements)
    with local_mode():
        for r, t in target._locals.items():
            paddle.assign(out._locals[r], output=t)
    return True


def install_shadow_readers() -> None:
    """A shadowed plain tensor read directly (``numpy()``, ``item()``, ``tolist()``) gives the distributed
    value, not the stale buffer."""
    for name in ("numpy", "item", "tolist"):
        orig = getattr(paddle.Tensor, name)

        def reader(self, *args, __orig=orig, __name=name, **kwargs):
            sh = shadows.shadow_of(self)
            if sh is None:
                return __orig(self, *args, **kwargs)
            return getattr(sh, __name)(*args, **kwargs) if __name != "tolist" else sh.numpy().tolist()

        patches.patch(paddle.Tensor, name, _mark(reader, orig, name))


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
    patches.patch(paddle.Tensor, "__setitem__", setitem)


def install_casts() -> None:
    """Cast spellings on paddle.Tensor (a DistParameter's), through the cast rule; DistTensor has its own
    (dist_tensor_ops)."""
    def conversion(name):
        orig = getattr(paddle.Tensor, name)

        def method(self, *args, **kwargs):
            if not D.is_dist(self) or _ctx.local_depth > 0:
                return orig(self, *args, **kwargs)
            dtype = aliases.conversion_dtype(name, _dtype_of(self))
            if normalize_dtype(dtype) == normalize_dtype(_dtype_of(self)):
                return self                     # paddle's: x.float() of a float32 tensor is x itself, no op
            return D.run("cast", "paddle.cast", (self, dtype), {})
        return _mark(method, orig, name)

    def type_as(self, other):
        if not D.is_dist(self) or _ctx.local_depth > 0:
            return aliases.original(paddle.Tensor.type_as)(self, other)
        if normalize_dtype(_dtype_of(other)) == normalize_dtype(_dtype_of(self)):
            return self
        return D.run("cast", "paddle.cast", (self, _dtype_of(other)), {})

    def to(self, *args, **kwargs):
        if not (D._any_dist((self,) + args, kwargs)) or _ctx.local_depth > 0:
            return aliases.original(paddle.Tensor.to)(self, *args, **kwargs)
        dtype = aliases.to_dtype(_dtype_of(self), args, kwargs)
        if normalize_dtype(dtype) == normalize_dtype(_dtype_of(self)):
            return self
        return D.run("cast", "paddle.cast", (self, dtype), {})

    for name in aliases._CONVERSIONS:
        if hasattr(paddle.Tensor, name) and not getattr(getattr(paddle.Tensor, name), "_ap_wrapper", False):
            _set_tensor_method(name, conversion(name))
    for name, fn in (("type_as", type_as), ("to", to)):
        if not getattr(getattr(paddle.Tensor, name), "_ap_wrapper", False):
            _set_tensor_method(name, _mark(fn, getattr(paddle.Tensor, name), name))
    for name in ("T", "mT"):
        prop = inspect.getattr_static(paddle.Tensor, name, None)
        if isinstance(prop, property) and not getattr(prop.fget, "_ap_wrapper", False):
            _set_tensor_method(name, property(_mark(_transposed(name, prop.fget), prop.fget, name)))


def _transposed(name, orig):
    """``p.T`` / ``p.mT`` of a distributed parameter: the transpose rule (paddle's properties call the C op on the
    object, which for a DistParameter is its local shard: ``x @ w.T`` took a shard's transpose as a whole
    replicated tensor)."""
    def getter(self):
        if not D.is_dist(self) or _ctx.local_depth > 0 or self.ndim < 2:
            return orig(self)
        n = self.ndim
        perm = list(range(n))[::-1] if name == "T" else list(range(n - 2)) + [n - 1, n - 2]
        return D.run("transpose", "paddle.transpose", (self, perm), {})
    return getter


def _dtype_of(x):
    return as_dist(x).dtype if D.is_dist(x) else x.dtype


def _mark(fn, orig, name):
    fn.__wrapped__ = orig
    fn.__name__ = name
    fn.__doc__ = getattr(orig, "__doc__", None)
    fn._ap_wrapper = True
    fn._ap_cast = True
    return fn


def _set_tensor_method(name, fn):
    patches.patch(paddle.Tensor, name, fn)      # DistTensor's own forms: dist_tensor_ops


def install_metadata() -> None:
    """``paddle.is_tensor`` is true for a DistTensor (see dist_tensor.py for what it answers locally)."""
    orig = paddle.is_tensor
    if getattr(orig, "_ap_wrapper", False):
        return

    def is_tensor(x):
        return type(x) is DistTensor or orig(x)

    _mark(is_tensor, orig, "is_tensor")
    aliases.repoint_modules({id(orig): is_tensor})        # paddle.is_tensor, paddle.tensor.logic... and importers
