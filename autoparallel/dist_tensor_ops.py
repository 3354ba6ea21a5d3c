"""The op methods of DistTensor, generated from the op table (``spmd_rules.op_table.OP_TABLE``).

``DistTensor`` inherits ``OpMethods``: every ``paddle.Tensor`` method and operator that is an op in the table,
under each of the names paddle gives it (``x.add``, ``x.__add__``, ``x.__radd__``, an alias bound to the same
function or to the C op it forwards to), its in-place form (``x.add_``: the out-of-place rule, then ``x`` takes
the result), the cast spellings (``x.float()``, ``x.type_as(y)``, ``x.to(...)``), ``x[i] = v``, ``T``/``mT``,
``new_*`` and ``__getattr__`` for the rest (a clear error naming the method). Each method goes through
``dispatch_handle.call``, which raises while dispatch is uninstalled. Methods DistTensor defines itself
(metadata: ``dim``, ``numel``, ``fill_``...) take precedence, being on the subclass.
"""
from __future__ import annotations

import paddle

from autoparallel import dispatch_handle
from autoparallel.compat import forwarded_c_op, owner_of
from autoparallel.spec import normalize_dtype

# paddle's cast methods: ``x.float()``, ``x.float32()``, ``x.int64()``, ``x.byte()`` / ``x.uint8()`` ... (paddle's own
# table of names, math_op_patch._supported_dtype_conversions, plus its two uint8 spellings); the dtype-named ones
# (``float32``, ``int64``...) were refused as "not an op"
CONVERSIONS = ("float", "half", "bfloat16", "double", "int", "long", "bool", "short", "char", "cfloat", "cdouble",
               "float16", "float32", "float64", "int8", "int16", "int32", "int64", "complex64", "complex128",
               "byte", "uint8")


def original(f):
    """``f`` without the wrappers dispatch put around it."""
    while getattr(f, "_ap_wrapper", False):
        f = f.__wrapped__
    return f


def _op_paths() -> dict:
    """id(original paddle callable) -> (op, path) of the op table's entries (the last path of an object wins,
    as installation routes each name and keeps the last wrapper per original)."""
    out = {}
    for op, paths in OP_TABLE.items():
        for path in paths:
            try:
                owner, attr = owner_of(path)
            except (ValueError, AttributeError):
                continue
            fn = original(getattr(owner, attr, None))
            if fn is not None:
                out[id(fn)] = (op, path)
    return out


def _c_op_paths(routed: dict, objects: dict) -> dict:
    """The C op a routed python function forwards to (``def _matmul(*a, **k): return _C_ops.matmul(...)``) is
    the same op: a Tensor method bound to the C op routes like the function (see aliases._c_op_aliases)."""
    out = {}
    for key, entry in routed.items():
        target = forwarded_c_op(objects.get(key))
        if target is not None and id(target) not in routed:
            out[id(target)] = entry
    return out


def method_table() -> dict:
    """{method name: (op, path, inplace)} of every routed ``paddle.Tensor`` name."""
    table = {}
    for op, paths in OP_TABLE.items():
        for path in paths:
            if path.startswith("paddle.Tensor."):
                table[path[len("paddle.Tensor."):]] = (op, path, path in IN_PLACE_PATHS)
    objects = {}
    for op, paths in OP_TABLE.items():
        for path in paths:
            try:
                owner, attr = owner_of(path)
                fn = original(getattr(owner, attr, None))
            except (ValueError, AttributeError):
                continue
            if fn is not None:
                objects[id(fn)] = fn
    routed = _op_paths()
    routed.update(_c_op_paths(routed, objects))
    _ROUTED.update(routed)
    aliases = {}
    for attr in dir(paddle.Tensor):
        if attr.startswith("__"):
            continue
        entry = routed.get(id(original(getattr(paddle.Tensor, attr, None))))
        if entry is not None:
            aliases[attr] = (entry[0], entry[1], False)
    for name, entry in aliases.items():
        table.setdefault(name, entry)
    routed_names = set(table)
    for attr in dir(paddle.Tensor):
        if attr.endswith("_") and not attr.startswith("_") and attr[:-1] in routed_names and attr not in table:
            op, path, _ = table[attr[:-1]]
            table[attr] = (op, path, True)
    return table


_ROUTED: dict = {}        # id(original paddle callable) -> (op, path), filled by method_table()


def _late_method(name):
    """A routed name put on ``paddle.Tensor`` after this module was imported (a library binding an op as a
    Tensor method): its method, made once and kept on the class; None for any other name."""
    entry = _ROUTED.get(id(original(getattr(paddle.Tensor, name, None))))
    inplace = False
    if entry is None and name.endswith("_") and not name.startswith("_"):
        base = getattr(OpMethods, name[:-1], None) or _late_method(name[:-1])
        entry, inplace = (getattr(base, "_ap_op", None), True) if base is not None else (None, False)
    if entry is None:
        return None
    fn = _method(name, entry[0], entry[1], inplace)
    setattr(OpMethods, name, fn)
    return fn


def _method(name, op, path, inplace):
    if inplace:
        def method(self, *args, __op=op, __path=path, **kwargs):
            return dispatch_handle.call_inplace(__op, __path, self, (self,) + args, kwargs)
    else:
        def method(self, *args, __op=op, __path=path, **kwargs):
            return dispatch_handle.call(__op, __path, (self,) + args, kwargs)
    method.__name__ = name
    method._ap_op = (op, path)
    return method


def _conversion(name):
    def method(self, *args, **kwargs):
        if normalize_dtype(conversion_dtype(name, self.dtype)) == normalize_dtype(self.dtype):
            return self                         # paddle's: x.float() of a float32 tensor is x itself, no op
        if name in ("byte", "uint8") and paddle.is_floating_point(paddle.zeros([], dtype=self.dtype)):
            # paddle casts a float to uint8 through int8 (-1.0 -> 255), as it cannot cast it directly
            self = dispatch_handle.call("cast", "paddle.cast", (self, "int8"), {})
        return dispatch_handle.call("cast", "paddle.cast", (self, conversion_dtype(name, self.dtype)), {})

    method.__name__ = name
    return method


def conversion_dtype(name: str, dtype):
    """The dtype paddle's ``Tensor.<name>()`` converts a tensor of ``dtype`` to."""
    return original(getattr(paddle.Tensor, name))(paddle.zeros([], dtype=dtype)).dtype


def to_dtype(self_dtype, args, kwargs, dist_type=None):
    """The dtype ``Tensor.to(*args, **kwargs)`` gives a tensor of ``self_dtype`` (paddle's own parser, run
    on a 0-d tensor on the default place; a distributed ``other`` (of ``dist_type``) stands in as a 0-d tensor of
    its dtype); a move to a device of another kind than the default place's is refused."""
    def stand_in(v):
        return paddle.zeros([], dtype=v.dtype) if dist_type is not None and isinstance(v, dist_type) else v

    out = original(paddle.Tensor.to)(paddle.zeros([], dtype=self_dtype), *[stand_in(a) for a in args],
                                     **{k: stand_in(v) for k, v in kwargs.items()})
    if _device_kind(out.place) != _device_kind(paddle.device.get_device()):      # ("cpu" on a GPU too)
        raise NotImplementedError("Tensor.to: moving a distributed tensor to another device is not supported; "
                                  "shards live where their ranks run")
    return out.dtype


def _type_as(self, other):
    if normalize_dtype(other.dtype) == normalize_dtype(self.dtype):
        return self
    return dispatch_handle.call("cast", "paddle.cast", (self, other.dtype), {})


def _to(self, *args, **kwargs):
    dtype = to_dtype(self.dtype, args, kwargs, type(self))
    if normalize_dtype(dtype) == normalize_dtype(self.dtype):
        return self
    return dispatch_handle.call("cast", "paddle.cast", (self, dtype), {})


def _to_private(self, device=None, dtype=None, blocking=None):
    """paddle's ``Tensor._to(device=, dtype=)`` (hapi moves outputs to the current device): the tensor itself on
    the device its shards live on, a cast for ``dtype``; moving shards to another device is refused."""
    if device is not None and _device_kind(device) != _device_kind(paddle.device.get_device()):
        raise NotImplementedError(f"Tensor._to(device={device!r}): moving the shards of a distributed tensor to "
                                  f"another device is not supported; shards live where their ranks run")
    return self if dtype is None else _to(self, dtype)


def _device_kind(device) -> str:
    """"cpu" / "gpu" / ... of a device string or Place (``"gpu:0"``, ``paddle.CUDAPlace(0)``)."""
    text = str(device).lower()
    return "gpu" if ("gpu" in text or "cuda" in text) else "cpu" if "cpu" in text else text.split(":")[0]


def _setitem(self, index, value):
    dispatch_handle.call_inplace("setitem", "paddle.Tensor.__setitem__", self, (self, index, value), {})


def _new_like(name):
    """``x.new_zeros(...)`` & co.: a new plain tensor (replicated) with x's dtype, as paddle makes it."""
    def method(self, *args, **kwargs):
        return original(getattr(paddle.Tensor, name))(paddle.zeros([], dtype=self.dtype), *args, **kwargs)

    method.__name__ = name
    return method


def _device(self):
    """paddle's ``Tensor.device`` (metadata, not an op) of this process's shards: ``x.to(y.device, y.dtype)``."""
    for t in self._locals.values():
        return t.device
    return paddle.ones([]).device


def _transposed(self):
    if self.ndim < 2:
        return self
    return dispatch_handle.call("transpose", "paddle.transpose", (self, list(range(self.ndim))[::-1]), {})


def _matrix_transposed(self):
    perm = list(range(self.ndim - 2)) + [self.ndim - 1, self.ndim - 2]
    return dispatch_handle.call("transpose", "paddle.transpose", (self, perm), {})


def _getattr(self, name):
    if name.startswith("__"):
        raise AttributeError(name)
    if hasattr(paddle.Tensor, name):
        late = _late_method(name)
        if late is not None:
            return late.__get__(self)
        composite = getattr(paddle.Tensor, name)
        if getattr(composite, "_ap_composite", None):       # a decomposition into routed ops (dispatch_install)
            return composite.__get__(self)
        if _is_op_name(name):
            raise NotImplementedError(f"paddle.Tensor.{name} has no spmd rule, so it cannot run on a DistTensor; "
                                      f"register one with spmd_rules.register_spmd_rule({name!r})")
        raise TypeError(f"paddle.Tensor.{name} is not an op and has no meaning for a distributed tensor (its data "
                        f"is spread over ranks, with no single storage, device buffer or C++ tensor); use "
                        f".local / .locals for this rank's shards, or .full() for the gathered tensor")
    raise AttributeError(f"'DistTensor' object has no attribute {name!r}")


def _retain_grads(self):
    """paddle's ``retain_grads()`` on a non-leaf (a hidden activation read after backward while debugging): every
    held shard keeps its gradient, which ``.grad`` then returns in the tensor's gradient layout. It was refused as
    having no meaning for a distributed tensor."""
    for t in self.locals.values():
        if not t.stop_gradient:
            t.retain_grads()


# paddle.Tensor methods written in python over paddle's ops and the tensor's own attributes: on a DistTensor they run
# as written, their ops routed (``x.repeat(2, 1)`` is ``tile``, ``split_with_sizes`` slices, ``requires_grad_`` sets
# ``stop_gradient``); they were refused as "not an op"
PYTHON_FORMS = ("repeat", "split_with_sizes", "requires_grad_",      # paddle's python over routed ops
                "__rand__", "__ror__", "__rxor__", "__lshift__", "__rshift__", "__rlshift__", "__rrshift__")


def _gradient(self):
    """paddle's ``gradient()``: the gradient as a numpy array (the global value here), or None."""
    g = self.grad
    return None if g is None else g.numpy()


def _detach_(self):
    """paddle's in-place ``detach_()`` (a recurrent state cut between truncated-BPTT windows): every held shard
    leaves the graph; the tensor itself is returned."""
    for t in self.locals.values():
        t.detach_()
    return self


def _set_requires_grad(self, value) -> None:
    self.stop_gradient = not value


def _is_op_name(name) -> bool:
    """A Tensor method that is one of paddle's ops (also a public function of paddle or paddle.linalg);
    the others (``data_ptr``, ``cuda``, ``get_tensor``...) act on a single local storage."""
    import paddle.linalg
    import paddle.signal

    base = name[:-1] if name.endswith("_") else name
    return any(callable(getattr(m, base, None)) for m in (paddle, paddle.linalg, paddle.nn.functional, paddle.signal))


def _namespace() -> dict:
    ns = {name: _method(name, *entry) for name, entry in method_table().items()}
    ns.update({name: _conversion(name) for name in CONVERSIONS if hasattr(paddle.Tensor, name)})
    ns.update(type_as=_type_as, to=_to, _to=_to_private, __setitem__=_setitem, __getattr__=_getattr,
              __hash__=object.__hash__, T=property(_transposed), mT=property(_matrix_transposed),
              device=property(_device), retain_grads=_retain_grads)
    ns.update({name: _new_like(name) for name in dir(paddle.Tensor) if name.startswith("new_")})
    ns.update({name: original(getattr(paddle.Tensor, name)) for name in PYTHON_FORMS if hasattr(paddle.Tensor, name)})
    ns["requires_grad"] = property(lambda self: not self.stop_gradient, _set_requires_grad)
    ns["gradient"] = _gradient
    ns["detach_"] = _detach_
    ns["__array_ufunc__"] = None         # as paddle.Tensor: numpy hands ``array + x`` back to x's reflected operator
    ns["__slots__"] = ()
    ns["__doc__"] = "The op methods of DistTensor (generated from the op table; see autoparallel.dist_tensor_ops)."
    return ns


from spmd_rules.op_table import IN_PLACE_PATHS, OP_TABLE  # noqa: E402

OpMethods = type("OpMethods", (), _namespace())
