"""Paddle coupling in one place: the private paddle attributes autoparallel relies on, version differences,
dotted-path resolution, and side data kept for paddle objects without writing attributes onto them.

Private names used here (paddle 3.3): ``paddle.base.framework.global_var._dygraph_tracer_`` (None while
``paddle.jit.to_static`` builds a program), ``paddle.base.framework.EagerParamBase`` (the Parameter class),
``paddle._C_ops`` / ``paddle._pir_ops`` / ``paddle._legacy_C_ops`` (the C op namespaces paddle's generated
functions call through), ``paddle.base.core`` (``eager.Tensor`` without storage, ``TCPStore``) and
``paddle.distributed.collective._default_store`` (the job's TCPStore),
``paddle.distributed.fleet.recompute.recompute._recompute_without_reentrant`` (the non-reentrant recompute), a
convolution's ``_data_format`` and ``_in_channels``. Other modules reach them through this
module's names; a paddle version that moves one of them is handled here.
"""
from __future__ import annotations

import contextlib
import importlib
import weakref

AFTER_LOAD: list = []     # calls waiting for this module: hooks on paddle's import that fired while it imported paddle

import paddle  # noqa: E402
from paddle.base import core as _core
from paddle.base.framework import EagerParamBase  # noqa: F401,E402  (paddle's Parameter class)
from paddle.base.dygraph.tensor_patch_methods import TensorHookRemoveHelper  # noqa: F401,E402  (a hook's handle)
from paddle.base import framework as _framework
from paddle.base.framework import global_var as _FRAMEWORK

C_OPS = getattr(paddle, "_C_ops", None)
TCPStore = _core.TCPStore

# the namespaces paddle's generated functions look their C ops up in (never patched: the originals call them)
C_OP_NAMESPACES = ("paddle._C_ops", "paddle._pir_ops", "paddle._legacy_C_ops")


def building_static_program() -> bool:
    """Whether paddle is building a static program (``paddle.jit.to_static``): its per-thread framework state
    then has no dygraph tracer."""
    return _FRAMEWORK._dygraph_tracer_ is None


def static_value_converter():
    """``(owner, name)`` of the function paddle calls to turn a tensor into a program value while building a
    static program (``paddle.pir.core._convert_into_value``; patched by to_static lowering)."""
    import paddle.pir.core as pir_core

    return pir_core, "_convert_into_value"


def to_static_enabled(static_function) -> bool:
    """Whether ``paddle.jit.enable_to_static`` leaves ``static_function`` compiled (``_program_trans``)."""
    return static_function._program_trans.enable_to_static


def is_static_property(static_function) -> bool:
    """Whether a ``to_static`` function decorates a property (``StaticFunction._property``)."""
    return bool(getattr(static_function, "_property", False))


def dygraph_function(static_function):
    """The plain python function a ``to_static`` function wraps (``_dygraph_function``), or None."""
    return getattr(static_function, "_dygraph_function", None)


def call_dygraph(static_function, *args, **kwargs):
    """Run a ``to_static`` function eagerly (``_call_dygraph_function``)."""
    return static_function._call_dygraph_function(*args, **kwargs)


def input_spec_of(static_function):
    """The ``input_spec`` a ``to_static`` function was given (``_input_spec``), or None."""
    return getattr(static_function, "_input_spec", None)


def convert_into_value(tensor):
    """The program value paddle makes of ``tensor`` while building a static program
    (``paddle.pir.core._convert_into_value``, looked up on each call: to_static lowering patches it)."""
    import paddle.pir.core as pir_core

    return pir_core._convert_into_value(tensor)


def forwarded_c_op(fn):
    """The C op a python function paddle generates as ``def _matmul(*args, **kwargs): return
    _C_ops.matmul(...)`` forwards to (one op, one argument parser), or None for any other callable."""
    from autoparallel.binding import _parsed_in_c

    if fn is None or not _parsed_in_c(fn):
        return None
    names = [n for n in fn.__code__.co_names if n != "_C_ops"]
    return getattr(C_OPS, names[-1], None) if names else None


def storage_free_tensor(dtype, shape, name):
    """A dense ``paddle.Tensor`` with a shape and no storage (filled later)."""
    return _core.eager.Tensor(dtype, list(shape), name, _core.VarDesc.VarType.DENSE_TENSOR, False)


def default_store():
    """The job's TCPStore (``paddle.distributed.collective._default_store``), or None."""
    import paddle.distributed.collective as coll

    return coll._default_store


def set_default_store(store) -> None:
    import paddle.distributed.collective as coll

    coll._default_store = store


def register_after_accumulate_hook(t, fn) -> None:
    """Call ``fn()`` after ``t``'s gradient is accumulated, once per backward pass
    (``Tensor._register_backward_hook``)."""
    t._register_backward_hook(fn)


def main_global_block():
    """The global block of paddle's default main program (``paddle.base.framework.default_main_program``),
    where an eager optimizer's ``_create_accumulators`` expects to be pointed."""
    from paddle.base import framework

    return framework.default_main_program().global_block()


def expected_place():
    """The place paddle puts new tensors on (``paddle.framework._current_expected_place``)."""
    return paddle.framework._current_expected_place()


def paddle_place(place):
    """paddle's parser of a device given as a string or a Place (``"cpu"``, ``"gpu:0"``, ``paddle.CPUPlace()``)."""
    return _framework._get_paddle_place(place)


def grad_enabled() -> bool:
    """Whether the dygraph tracer records gradients (``_dygraph_tracer()._has_grad``)."""
    return _framework._dygraph_tracer()._has_grad


def set_grad_enabled(enabled: bool) -> None:
    """Switch gradient recording of the dygraph tracer in place (no context object; callers restore it)."""
    _framework._dygraph_tracer()._has_grad = enabled


def no_dygraph():
    """A context in which paddle builds static programs even in dygraph mode (``_dygraph_guard(None)``)."""
    return _framework._dygraph_guard(None)


def register_saved_tensors_hooks(pack, unpack) -> None:
    """Make ``pack``/``unpack`` the autograd saved-tensor hooks (``core.eager``, as
    ``paddle.autograd.saved_tensors_hooks`` does on entry)."""
    _core.eager.register_saved_tensors_hooks(pack, unpack)


def reset_saved_tensors_hooks() -> None:
    _core.eager.reset_saved_tensors_hooks()


def lazy_init_method():
    """``(owner, name)`` of the method paddle runs to initialise a parameter created under ``LazyGuard``
    (``Initializer._lazy_init``; patched to stamp the creation order)."""
    from paddle.nn.initializer.initializer import Initializer

    return Initializer, "_lazy_init"


def reentrant_recompute():
    """``(RecomputeFunction, _recompute_without_reentrant)`` of ``paddle.distributed.fleet.recompute.recompute``:
    the PyLayer paddle's reentrant recompute applies, and the saved-tensor-hooks recompute it runs otherwise
    (called as ``(function, get_state, set_state, preserve_rng_state, *args, **kwargs)``)."""
    rc = importlib.import_module("paddle.distributed.fleet.recompute.recompute")   # the package re-exports a function
    return rc.RecomputeFunction, rc._recompute_without_reentrant


def non_reentrant_recompute_owner():
    """``(module, attribute name)`` through which paddle's ``recompute(..., use_reentrant=False)`` calls its
    saved-tensor-hooks recompute (a module global looked up at each call)."""
    return importlib.import_module("paddle.distributed.fleet.recompute.recompute"), "_recompute_without_reentrant"


def owner_of(path: str):
    """``(owner object, attribute name)`` of a dotted path such as ``paddle.nn.functional.relu`` or
    ``paddle.Tensor.__add__``: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:-1]:
            obj = getattr(obj, p)
        return obj, parts[-1]
    raise ValueError(f"cannot resolve {path!r}")


def resolve(path: str):
    owner, attr = owner_of(path)
    return getattr(owner, attr)


class SideData:
    """Values attached to objects (paddle tensors, parameters, layers, functions) without setting attributes on
    them: keyed by identity, dropped when the object is collected. Works for unhashable objects and for
    objects whose ``==`` is elementwise (tensors), which a ``WeakKeyDictionary`` would call on collisions."""

    __slots__ = ("_items", "__weakref__")

    def __init__(self):
        self._items: dict = {}          # id(obj) -> (weakref to obj, value)

    def get(self, obj, default=None):
        entry = self._items.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return default
        return entry[1]

    def __contains__(self, obj) -> bool:
        entry = self._items.get(id(obj))
        return entry is not None and entry[0]() is obj

    def set(self, obj, value) -> None:
        key = id(obj)
        items = self._items

        def drop(_ref, key=key, items=items):
            entry = items.get(key)
            if entry is not None and entry[0] is _ref:
                del items[key]

        items[key] = (weakref.ref(obj, drop), value)

    def pop(self, obj, default=None):
        if obj not in self:
            return default
        return self._items.pop(id(obj))[1]

    def __len__(self) -> int:
        return len(self._items)


class WeakAttr:
    """An attribute holding its object weakly (None once it is collected): for records that a registry keyed by
    that same object keeps (``SideData`` values, module globals), which would otherwise keep it alive forever.
    Objects that refuse weak references (builtins) are held strongly."""

    def __set_name__(self, owner, name):
        self.slot = "_weak_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        ref = obj.__dict__.get(self.slot)
        return ref() if callable(ref) else None

    def __set__(self, obj, value) -> None:
        try:
            ref = None if value is None else weakref.ref(value)
        except TypeError:
            ref = (lambda v: lambda: v)(value)
        obj.__dict__[self.slot] = ref


@contextlib.contextmanager
def gpu_place_for_grad_scaler():
    """Inside the block ``paddle.amp.GradScaler`` reads the tracer's place as a GPU place (it swaps
    ``paddle.amp.grad_scaler._dygraph_tracer``), so a scaler built there stays enabled on a CPU machine."""
    from paddle.amp import grad_scaler as gs

    class Place:
        def is_gpu_place(self):
            return True

    class Tracer:
        _expected_place = Place()

    original = gs._dygraph_tracer
    gs._dygraph_tracer = lambda: Tracer()
    try:
        yield
    finally:
        gs._dygraph_tracer = original


def conv_input_layout(conv) -> tuple:
    """(channels_last, in_channels) of a paddle ``Conv1D``/``Conv2D``/``Conv3D``: paddle keeps the data format and
    the input channel count only as the private ``_data_format`` and ``_in_channels``."""
    return conv._data_format in ("NLC", "NHWC", "NDHWC"), int(conv._in_channels)


def layer_cast_slot():
    """(owner, name) of paddle's per-tensor cast behind ``Layer.to(dtype=...)`` / ``bfloat16()`` / ``float()``."""
    return paddle.nn.Layer, "_transform"


@contextlib.contextmanager
def gpu_place_for_amp_decorate():
    """Inside the block ``paddle.amp.decorate`` reads the tracer's place as a GPU place supporting float16 and
    bfloat16 (on a CPU it returns the models and optimizers untouched), so its O2 cast, master-weight flag and
    ``save_dtype`` hook can be exercised on a CPU machine. Everything else of the tracer is the real one."""
    ac = importlib.import_module("paddle.amp.auto_cast")
    real = ac._dygraph_tracer

    class Place:
        def is_gpu_place(self):
            return True

        def is_xpu_place(self):
            return False

        def is_custom_place(self):
            return False

    class Tracer:
        _expected_place = Place()

        def __getattr__(self, name):
            return getattr(real(), name)

    saved = ac._dygraph_tracer, ac._is_gpu_bfloat16_supported, ac._is_gpu_float16_supported
    ac._dygraph_tracer = lambda: Tracer()
    ac._is_gpu_bfloat16_supported = ac._is_gpu_float16_supported = lambda: True
    try:
        yield
    finally:
        ac._dygraph_tracer, ac._is_gpu_bfloat16_supported, ac._is_gpu_float16_supported = saved


for _call in AFTER_LOAD:      # paddle was first imported by this module (autoparallel/__init__: param_carry.install)
    _call()
AFTER_LOAD.clear()


@contextlib.contextmanager
def fresh_parameter_names():
    """A name generator of its own for what is built inside (``paddle.base.unique_name.switch``): paddle refuses a
    second parameter of a name given by ``ParamAttr(name=...)`` in one process, and a rebuilt model names its
    parameters again; generated names go on numbering as they were once the block ends."""
    from paddle.base import unique_name

    old = unique_name.switch(unique_name.generator)
    try:
        yield
    finally:
        unique_name.switch(*old)
