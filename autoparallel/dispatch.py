"""Op interception: a paddle op that receives a DistTensor or DistParameter runs through its spmd rule.

    rule(input specs) -> reshard inputs to what the rule requires -> local paddle op on every held rank
    -> DistTensor outputs with the rule's output specs

Routing covers every dotted path in ``spmd_rules.op_table.OP_TABLE`` plus the places paddle's layers
imported those functions into (``paddle.nn.layer.norm.layer_norm`` ...). The remaining public callables
of ``paddle``, ``paddle.nn.functional``, ``paddle.linalg`` and the math methods of ``paddle.Tensor`` are
guarded: given a distributed tensor they raise ``NotImplementedError`` naming the op and
``register_spmd_rule``. Plain tensors pay one isinstance scan. While a local op runs (``local_mode``)
nothing is routed, so paddle's own code inside an op sees plain tensors.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect

import paddle
from paddle.base.framework import EagerParamBase
from spmd_rules import get_spmd_rule, has_spmd_rule
from spmd_rules.op_table import ARG_MAP, OP_TABLE
from spmd_rules.errors import DataDependentShapeError
from spmd_rules.registry import flatten_specs, replace_specs
from spmd_rules.result import LocalShaped

from autoparallel import aliases, binding, dispatch_cache, local_ops
from autoparallel.comm import fanout
from autoparallel.comm.world import current_world
from autoparallel.graph import trace as trace_state
from autoparallel.dist_tensor import DistParameter, DistTensor, as_dist
from autoparallel.placement import Replicate
from autoparallel.spec import DistSpec, normalize_dtype

_ORIG: dict = {}          # dotted path -> original callable
_INSTALLED = False


from autoparallel.local_mode import in_local_mode, local_mode  # noqa: E402  (re-exported)
from autoparallel import tensor_forms  # noqa: E402
from autoparallel.tensor_forms import SHADOWS  # noqa: E402
from autoparallel.local_mode import _state as _local_state  # noqa: E402


from paddle.base.framework import global_var as _paddle_mode  # noqa: E402  (_dygraph_tracer_ None: static)


def is_dist(x) -> bool:
    return type(x) is DistTensor or (isinstance(x, DistParameter) and hasattr(x, "_ap_spec"))


def _any_dist(args, kwargs) -> bool:
    for v in args:
        t = v.__class__
        if t is DistTensor or ((t is list or t is tuple) and any(is_dist(u) for u in v)) or \
                (isinstance(v, DistParameter) and hasattr(v, "_ap_spec")):
            return True
    if kwargs:
        for v in kwargs.values():
            if is_dist(v) or (type(v) in (list, tuple) and any(is_dist(u) for u in v)):
                return True
    return SHADOWS[0] and tensor_forms._has_shadow(args, kwargs)


def _tracing_tensors(args, kwargs) -> bool:
    """While tracing, ops on (possibly lazy, unallocated) parameters are recorded too — in eager runs those
    parameters are distributed, so the traced op sequence is the eager one; constants are computed."""
    if trace_state.active() is None:
        return False
    return any(isinstance(v, EagerParamBase) for v in flatten_specs(args, kwargs, is_leaf=_is_tensor_leaf))


def _is_tensor_leaf(v) -> bool:
    return isinstance(v, (DistTensor, paddle.Tensor))


def _is_spec(v) -> bool:
    return isinstance(v, DistSpec)


# ---- the routed call ------------------------------------------------------------------------------------------
def run(op: str, path: str, args, kwargs):
    """Run paddle callable ``path`` (rule ``op``) on distributed arguments.

    A call whose key (see dispatch_cache) was seen before reuses its plan: no rule, no validation, no
    reshard planning; only the data-dependent steps run."""
    if _paddle_mode._dygraph_tracer_ is None:            # paddle.jit.to_static building a program
        from autoparallel.graph.jit import static_args
        args, kwargs = static_args(op, args, kwargs)
    if SHADOWS[0]:
        args, kwargs = tensor_forms._unshadow(args, kwargs)
    args, kwargs = _bind(op, path, tuple(args), dict(kwargs))
    if path in ARG_MAP:
        args, kwargs = _map_args(path, args, kwargs)
    rule = get_spmd_rule(op)
    tracer = trace_state.active()
    if tracer is not None:
        return _run_traced(op, rule, args, kwargs, tracer)
    leaves = []
    args_key = dispatch_cache.call_key(args, kwargs, leaves)
    if args_key is None:
        leaves = _leaves(args, kwargs)
    world = current_world()
    pins = getattr(_pin_state, "plan", None)
    pinned_res = None
    if pins is not None:
        mesh = _common_mesh(op, leaves)
        pinned_res = pins.next(op, [_to_dist(v, mesh).spec for v in leaves])
    key, plan = dispatch_cache.find(rule, path, world, args_key, pinned_res)
    if plan is not None:
        out = _wrap(plan.res, _execute(op, path, plan.res, plan.mesh, plan.calls(leaves, args, kwargs)), plan.held)
        if plan.derives is not None:        # a cast / view of a parameter (dispatch_cache.DATA_FREE)
            fanout.note_derived(out, leaves[plan.derives])
        return out
    plan = _plan_call(op, rule, args, kwargs, leaves, pinned_res, world)
    outs = _execute(op, path, plan.res, plan.mesh, plan.calls(leaves, args, kwargs))
    check_outputs(op, plan, outs)           # once per call signature: the plan is cached only when it holds
    dispatch_cache.store(key, plan)
    out = _wrap(plan.res, outs, plan.held)
    if plan.derives is not None:
        fanout.note_derived(out, leaves[plan.derives])
    return out


_BINDERS: dict = {}       # dotted path -> Binder of its paddle callable (None: no python signature)


def _bind(op, path, args, kwargs):
    """The call in its canonical form (see autoparallel.binding), as paddle would bind it."""
    b = _BINDERS.get(path, False)
    if b is False:
        fn = _CUSTOM.get(path) or _ORIG.get(path)
        if fn is None:
            try:
                fn = _resolve(path)
            except (ValueError, AttributeError):
                fn = None
        b = binding.binder(fn) if fn is not None and binding.has_signature(fn) else None
        if not path.startswith("custom."):
            _BINDERS[path] = b
    if b is None:
        return args, kwargs
    try:
        return b(args, kwargs)
    except TypeError as e:
        raise TypeError(f"{path}: {e}") from None


def check_outputs(op, plan, outs) -> None:
    """The first call of a signature: the rule's output specs must describe what the op produced on every
    held rank (count, local shape, dtype); a rule that disagrees would give tensors whose metadata lies."""
    specs = plan.res.outputs
    for r in plan.held:
        got = outs[r]
        if len(got) != len(specs):
            raise TypeError(f"spmd rule {op!r} returned {len(specs)} output spec(s) but the op produced "
                            f"{len(got)} output(s) on inputs {_specs_str(plan.res.inputs)}")
        coords = plan.mesh.coords_of(r)
        for k, (t, spec) in enumerate(zip(got, specs)):
            if spec is None or t is None or not isinstance(t, paddle.Tensor) or spec.__class__ is LocalShaped:
                continue
            want = tuple(spec.local_shape(coords))
            if tuple(t.shape) != want or normalize_dtype(t.dtype) != spec.dtype:
                raise ValueError(f"spmd rule {op!r}: output {k} is declared {spec.dtype}{list(spec.shape)} "
                                 f"[{', '.join(map(str, spec.placements))}] (local {list(want)} on rank {r}), "
                                 f"but the op produced {normalize_dtype(t.dtype)}{list(t.shape)} there; inputs "
                                 f"{_specs_str(plan.res.inputs)}")


def _specs_str(specs) -> str:
    return "(" + ", ".join(f"{s.dtype}{list(s.shape)}[{', '.join(map(str, s.placements))}]" for s in specs) + ")"


def _plan_call(op, rule, args, kwargs, leaves, res, world) -> dispatch_cache.CallPlan:
    """Ask the rule (unless layouts are pinned) and plan the call."""
    mesh = _common_mesh(op, leaves)
    specs = [_to_dist(v, mesh).spec for v in leaves]
    if res is None:
        spec_args, spec_kwargs = replace_specs(args, kwargs, specs, is_leaf=_is_tensor_leaf)
        res = _ask_rule(op, rule, specs, spec_args, spec_kwargs)
    return dispatch_cache.CallPlan(rule, res, mesh, leaves, specs, args, kwargs, world)


def _ask_rule(op, rule, specs, spec_args, spec_kwargs):
    """The rule's result; an error raised inside the rule names the op and the input specs."""
    try:
        return rule(*spec_args, **spec_kwargs)
    except NotImplementedError as e:
        if isinstance(e, DataDependentShapeError) or "spmd rule" in str(e) or str(e).startswith(f"{op}:"):
            raise
        raise NotImplementedError(f"spmd rule {op!r} failed on inputs {_specs_str(specs)}: {e}") from e
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, ZeroDivisionError) as e:
        if isinstance(e, DataDependentShapeError):
            raise
        raise type(e)(f"spmd rule {op!r} failed on inputs {_specs_str(specs)}: {e}") from e


def _run_traced(op, rule, args, kwargs, tracer):
    leaves = _leaves(args, kwargs)
    mesh = _common_mesh(op, leaves, tracer)
    dists = [_to_dist(v, mesh, tracer) for v in leaves]
    spec_args, spec_kwargs = replace_specs(args, kwargs, [d.spec for d in dists], is_leaf=_is_tensor_leaf)
    pins = getattr(_pin_state, "plan", None)
    res = pins.next(op, [d.spec for d in dists]) if pins is not None else None
    if res is None:
        res = rule(*spec_args, **spec_kwargs)
    return _trace(tracer, op, dists, res)


import threading as _threading  # noqa: E402

_pin_state = _threading.local()


def _prime_thread_state() -> None:
    """Give this thread's per-thread flags read on every call their neutral values: looking up a missing
    attribute of a ``threading.local`` raises internally and costs ~0.6 µs each time."""
    from autoparallel.comm import world as world_mod

    for state, attr, value in ((_pin_state, "plan", None), (trace_state._state, "tracer", None),
                               (_local_state, "depth", 0), (world_mod._state, "stack", None)):
        if not hasattr(state, attr):
            setattr(state, attr, value)


class PinnedLayouts:
    """Layouts decided ahead of time (by whole-graph completion): the k-th routed op of a forward uses
    ``results[k]`` (an SpmdResult from its rule) instead of asking the rule again. ``None`` entries fall
    back to the rule. An op-name mismatch means the forward differs from the traced one: an error."""

    def __init__(self, ops, results, base: int = 0):
        self.ops, self.results, self.k, self.base = list(ops), list(results), 0, base

    def next(self, op, input_specs):
        if self.k >= len(self.ops):
            raise RuntimeError(f"pinned layouts cover {len(self.ops)} ops but the forward ran more "
                               f"(op {self.base + self.k}: {op}); re-trace the model")
        want, res = self.ops[self.k], self.results[self.k]
        if want != op:
            raise RuntimeError(f"pinned layouts expected op {self.base + self.k} to be {want!r}, the forward ran "
                               f"{op!r}; re-trace the model")
        self.k += 1
        return res

    def segment(self, start: int, end: int) -> "PinnedLayouts":
        """Entries ``start:end`` again, from the beginning (a recomputed region re-run in backward)."""
        return PinnedLayouts(self.ops[start:end], self.results[start:end], self.base + start)


@contextlib.contextmanager
def pinned(ops, results):
    """Run a forward with layouts pinned op by op (see PinnedLayouts)."""
    with _pins_as(PinnedLayouts(ops, results)) as plan:
        yield plan


@contextlib.contextmanager
def _pins_as(plan):
    prev = getattr(_pin_state, "plan", None)
    _pin_state.plan = plan
    try:
        yield plan
    finally:
        _pin_state.plan = prev


def replayable(fn):
    """``fn`` as a recompute region. While tracing, the ops it records carry the region's number
    (``tracer.region``). Under pinned layouts its first call consumes entries as usual and remembers which;
    a later call (the region re-run in backward, after the pinned forward has ended) replays exactly those
    entries, so the recomputed activations have the layouts of the original ones."""
    seen = {}

    def wrapper(*args, **kwargs):
        tracer = trace_state.active()
        if tracer is not None:
            return _traced_region(tracer, fn, args, kwargs)
        if seen:
            return _replay(seen, fn, args, kwargs)
        pins = getattr(_pin_state, "plan", None)
        seen.update(pins=pins, start=pins.k if pins is not None else 0)
        out = fn(*args, **kwargs)
        seen["end"] = pins.k if pins is not None else 0
        return out

    wrapper.__wrapped__ = fn
    return wrapper


def _traced_region(tracer, fn, args, kwargs):
    prev = getattr(tracer, "region", None)
    tracer.region = getattr(tracer, "regions", 0)
    tracer.regions = tracer.region + 1
    try:
        return fn(*args, **kwargs)
    finally:
        tracer.region = prev


def _replay(seen, fn, args, kwargs):
    pins = seen["pins"]
    segment = None if pins is None else pins.segment(seen["start"], seen["end"])
    with _pins_as(segment):
        out = fn(*args, **kwargs)
    if segment is not None and segment.k != len(segment.ops):
        last = segment.base + len(segment.ops) - 1
        raise RuntimeError(f"the recomputed region ran {segment.k} ops, its pinned forward {len(segment.ops)} "
                           f"(ops {segment.base}..{last}); re-trace the model")
    return out


def _trace(tracer, op, dists, res):
    """Record the op and return spec-only outputs (nothing is computed)."""
    from reshard import plan_reshard

    from autoparallel.comm.world import planning_cluster

    if any(s.__class__ is LocalShaped for s in res.outputs):
        raise DataDependentShapeError(f"{op}: its output size depends on the values, which graph tracing "
                                      f"(ap.trace, ModelSpec.from_trace, auto_mode='full') does not compute; give "
                                      f"the degrees yourself (auto_mode='semi', which runs eagerly) or keep {op} "
                                      f"outside the traced region")
    reshards = [plan_reshard(d.spec.shape, d.spec.dtype, d.spec.mesh, d.spec.placements, req.placements,
                             cluster=planning_cluster())
                for d, req in zip(dists, res.inputs) if d.spec != req]
    outs = [None if s is None else DistTensor({}, s) for s in res.outputs]
    node = tracer.record(op, dists, res.inputs, res.outputs, reshards)
    for o in outs:
        if o is not None:
            tracer.producer[id(o)] = node
    return outs[0] if len(outs) == 1 else tuple(outs)


def _map_args(path, args, kwargs):
    how = ARG_MAP.get(path)
    if how == "swap":
        return (args[1], args[0]) + args[2:], kwargs
    if isinstance(how, dict) and "rename" in how:
        ren = how["rename"]
        kwargs = {ren.get(k, k): v for k, v in kwargs.items()}
    if isinstance(how, dict) and "fixed" in how:
        kwargs = {**kwargs, **how["fixed"]}
    return args, kwargs


def _leaves(args, kwargs) -> list:
    return flatten_specs(args, kwargs, is_leaf=_is_tensor_leaf)


def _common_mesh(op, leaves, tracer=None):
    meshes = {x.mesh if isinstance(x, DistTensor) else x._ap_spec.mesh for x in leaves if is_dist(x)}
    if not meshes and tracer is not None:
        return tracer.mesh
    if len(meshes) != 1:
        raise ValueError(f"{op}: every distributed input must live on one mesh; got tensors on "
                         f"{sorted(str(m) for m in meshes)} — reshard them onto one mesh first")
    return next(iter(meshes))


def _to_dist(v, mesh, tracer=None) -> DistTensor:
    if is_dist(v):
        return as_dist(v) if tracer is None else DistTensor({}, as_dist(v).spec) if not isinstance(v, DistTensor) else v
    if tracer is not None:                      # spec only: a (possibly lazy, unallocated) parameter or constant
        spec = tracer.param_specs.get(id(v)) or DistSpec(mesh, tuple(Replicate() for _ in range(mesh.ndim)),
                                                         tuple(v.shape), v.dtype)
        return DistTensor({}, spec)
    # a plain tensor next to distributed ones: the same value on every rank (replicated)
    spec = DistSpec(mesh, tuple(Replicate() for _ in range(mesh.ndim)), tuple(v.shape), v.dtype)
    return DistTensor({r: v for r in current_world().local_ranks(mesh.process_ids)}, spec)


def _execute(op, path, res, mesh, calls) -> dict:
    _local_state.depth = getattr(_local_state, "depth", 0) + 1        # local_mode(), without a generator
    try:
        if res.local_op in local_ops.GROUP:
            return {r: _as_tuple(o) for r, o in local_ops.GROUP[res.local_op](mesh, calls).items()}
        if res.local_op is not None:
            if res.local_op not in local_ops.PER_RANK:
                raise NotImplementedError(f"{op}: the rule asks for local op {res.local_op!r}, which the runtime "
                                          f"does not implement")
            fn = local_ops.PER_RANK[res.local_op]
        else:
            fn = _LOCAL_FN.get(path) or _local_callable(op, path)
            if ARG_MAP.get(path) == "swap":       # back to the reflected operator's own order
                calls = {r: ((a[1], a[0]) + tuple(a[2:]), k) for r, (a, k) in calls.items()}
        return {r: _as_tuple(fn(*a, **k)) for r, (a, k) in calls.items()}
    finally:
        _local_state.depth -= 1


_LOCAL_FN: dict = {}      # dotted path -> its local callable, once resolved (custom ops are looked up anew)


def _local_callable(op, path):
    """The path's own paddle callable (operators accept python scalars), or the op's canonical
    functional when the path renames arguments."""
    if path in _CUSTOM:
        return _CUSTOM[path]
    how = ARG_MAP.get(path)
    if isinstance(how, dict):
        paths = OP_TABLE.get(op) or (path,)
        fn = _ORIG.get(paths[0]) or _resolve(paths[0])
    else:
        fn = _ORIG.get(path) or _resolve(path)
    if _INSTALLED and not path.startswith("custom."):
        _LOCAL_FN[path] = fn
    return fn


def _as_tuple(o):
    if o.__class__ is tuple:
        return o
    return tuple(o) if isinstance(o, (tuple, list)) else (o,)


def _wrap(res, outs, held):
    specs = res.outputs
    if len(specs) == 1:
        spec = specs[0]
        if spec is None:
            return None
        if spec.__class__ is LocalShaped:
            spec = _resolved(spec, outs, held, 0)
        return DistTensor._own({r: outs[r][0] for r in held}, spec)
    return tuple(None if spec is None else
                 DistTensor._own({r: outs[r][k] for r in held},
                                 _resolved(spec, outs, held, k) if spec.__class__ is LocalShaped else spec)
                 for k, spec in enumerate(specs))


def _resolved(spec, outs, held, k):
    """A value-dependent output: replicated, so every held rank's local result is the global one."""
    first = outs[held[0]][k]
    for r in held[1:]:
        if tuple(outs[r][k].shape) != tuple(first.shape):
            raise RuntimeError(f"a value-dependent output differs in shape between ranks ({list(first.shape)} on "
                               f"rank {held[0]}, {list(outs[r][k].shape)} on rank {r}): its inputs were not "
                               f"the same on every rank")
    return spec.resolve(first.shape, first.dtype)


# ---- installation -----------------------------------------------------------------------------------------------
def _resolve(path):
    owner, attr = _owner(path)
    return getattr(owner, attr)


def _owner(path):
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        modname = ".".join(parts[:i])
        try:
            obj = importlib.import_module(modname)
        except ImportError:
            continue
        for p in parts[i:-1]:
            obj = getattr(obj, p)
        return obj, parts[-1]
    raise ValueError(f"cannot resolve {path!r}")


def _routed(op, path, orig):
    def wrapper(*args, **kwargs):
        if getattr(_local_state, "depth", 0) > 0 or not (_any_dist(args, kwargs) or _tracing_tensors(args, kwargs)):
            return orig(*args, **kwargs)
        return run(op, path, args, kwargs)

    wrapper.__wrapped__ = orig
    wrapper.__name__ = getattr(orig, "__name__", path.rsplit(".", 1)[-1])
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper._ap_routed = op
    wrapper._ap_path = path
    wrapper._ap_wrapper = True
    return wrapper


_CUSTOM: dict = {}        # "custom.<name>" -> the user's local implementation


def custom_op(name: str):
    """Make a python function of paddle ops dispatchable under the spmd rule ``name``::

        @register_spmd_rule("fused_swiglu")
        def rule(x, gate): ...
        @ap.custom_op("fused_swiglu")
        def fused_swiglu(x, gate): return F.silu(gate) * x

    On distributed tensors the rule decides the layouts and the function runs on each rank's shards;
    on plain tensors it is the function itself."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"custom_op expects the spmd rule name (a non-empty str), got {type(name).__name__} "
                        f"{name!r}; use it as @ap.custom_op('my_op')")

    def deco(fn):
        if not callable(fn):
            raise TypeError(f"custom_op({name!r}) decorates a function, got {type(fn).__name__} {fn!r}")
        path = f"custom.{name}"
        _CUSTOM[path] = fn

        def wrapper(*args, **kwargs):
            if in_local_mode() or not (_any_dist(args, kwargs) or _tracing_tensors(args, kwargs)):
                return fn(*args, **kwargs)
            if not has_spmd_rule(name):
                raise NotImplementedError(f"custom op {name!r} has no spmd rule; register one with "
                                          f"spmd_rules.register_spmd_rule({name!r})")
            return run(name, path, args, kwargs)

        wrapper.__wrapped__ = fn
        wrapper.__name__ = getattr(fn, "__name__", name)
        wrapper.__doc__ = fn.__doc__
        return wrapper

    return deco


def _guarded(name, orig):
    def wrapper(*args, **kwargs):
        if not in_local_mode() and _any_dist(args, kwargs):
            raise NotImplementedError(f"{name} has no spmd rule, so it cannot run on distributed tensors; "
                                      f"register one with spmd_rules.register_spmd_rule({name.rsplit('.', 1)[-1]!r})")
        return orig(*args, **kwargs)

    wrapper.__wrapped__ = orig
    wrapper.__name__ = getattr(orig, "__name__", name)
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper._ap_guard = True
    return wrapper


# Tensor methods that act on storage, not values: they keep working on a DistParameter's local shard.
_STORAGE_METHODS = {"numpy", "clone", "detach", "detach_", "set_value", "cpu", "cuda", "item", "tolist",
                    "backward", "register_hook", "clear_grad", "clear_gradient", "copy_", "get_tensor",
                    "value", "is_dense", "is_dist", "element_size", "numel", "dim", "ndimension",
                    "is_contiguous", "contiguous", "data_ptr", "get_strides", "to", "pin_memory",
                    "zero_", "fill_", "uniform_", "normal_", "stop_gradient", "shape", "dtype", "place",
                    "size", "is_leaf", "grad", "name", "persistable", "type", "_md5sum", "__format__",
                    "__repr__", "__str__", "__hash__", "__bool__", "__len__", "__array__", "__index__",
                    "__float__", "__int__", "__nonzero__", "__deepcopy__", "__reduce_ex__", "__setitem__",
                    "__iter__", "__contains__", "__dlpack__", "__array_ufunc__"}


def install() -> None:
    """Patch paddle once (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    routed = {}
    for op, paths in OP_TABLE.items():
        for path in paths:
            owner, attr = _owner(path)
            orig = getattr(owner, attr, None)
            if orig is None or getattr(orig, "_ap_routed", None):
                continue
            _ORIG[path] = orig
            w = _routed(op, path, orig)
            setattr(owner, attr, w)
            routed[id(orig)] = w
    methods = aliases.patch_aliases(routed)
    tensor_forms.install_setitem()
    methods.update(aliases.patch_inplace(tensor_forms.inplace_routed))
    tensor_forms.install_casts()
    tensor_forms.install_metadata()
    _install_guards()
    _install_dist_tensor_methods(methods)
    _prime_thread_state()
    from autoparallel.graph import jit
    jit.install()                                        # paddle.jit.to_static over distributed tensors
    _INSTALLED = True


def _install_guards() -> None:
    for modname in ("paddle", "paddle.nn.functional", "paddle.linalg"):
        mod = importlib.import_module(modname)
        for attr in dir(mod):
            if attr.startswith("_"):
                continue
            val = getattr(mod, attr)
            if not (inspect.isfunction(val) or inspect.isbuiltin(val)) or hasattr(val, "_ap_wrapper") \
                    or hasattr(val, "_ap_guard"):
                continue
            try:
                setattr(mod, attr, _guarded(f"{modname}.{attr}", val))
            except (AttributeError, TypeError):
                pass
    public = set(dir(paddle))
    for attr in dir(paddle.Tensor):
        if attr in _STORAGE_METHODS or attr.startswith("_") or attr not in public:
            continue
        val = getattr(paddle.Tensor, attr)
        if not callable(val) or hasattr(val, "_ap_wrapper") or hasattr(val, "_ap_guard") or isinstance(val, type):
            continue
        try:
            setattr(paddle.Tensor, attr, _guarded(f"paddle.Tensor.{attr}", val))
        except (AttributeError, TypeError):
            pass


def _install_dist_tensor_methods(methods: dict) -> None:
    """DistTensor (a wrapper) gets every routed paddle.Tensor method and operator, under each of its names,
    and the in-place forms."""
    for op, paths in OP_TABLE.items():
        for path in paths:
            if path.startswith("paddle.Tensor."):
                _dist_method(path[len("paddle.Tensor."):], op, path)
    for name, w in methods.items():
        if name not in DistTensor.__dict__:
            if getattr(w, "_ap_inplace", None):
                _dist_method(name, w._ap_inplace, w._ap_path, inplace=True)
            else:
                _dist_method(name, w._ap_routed, w._ap_path)
    DistTensor.__hash__ = object.__hash__
    DistTensor.T = property(lambda self: self if self.ndim < 2 else
                            run("transpose", "paddle.transpose", (self, list(range(self.ndim))[::-1]), {}))
    DistTensor.mT = property(lambda self: run("transpose", "paddle.transpose",
                                              (self, list(range(self.ndim - 2)) + [self.ndim - 1, self.ndim - 2]), {}))
    for name in [n for n in dir(paddle.Tensor) if n.startswith("new_")]:
        setattr(DistTensor, name, tensor_forms.new_like(name))


def _dist_method(name, op, path, inplace=False):
    def method(self, *args, __op=op, __path=path, **kwargs):
        out = run(__op, __path, (self,) + args, kwargs)
        return tensor_forms.rebind(__path, self, out) if inplace else out

    method.__name__ = name
    setattr(DistTensor, name, method)


def _dist_getattr(self, name):
    if name.startswith("__"):
        raise AttributeError(name)
    if hasattr(paddle.Tensor, name):
        if _is_op_name(name):
            raise NotImplementedError(f"paddle.Tensor.{name} has no spmd rule, so it cannot run on a DistTensor; "
                                      f"register one with spmd_rules.register_spmd_rule({name!r})")
        raise TypeError(f"paddle.Tensor.{name} is not an op and has no meaning for a distributed tensor (its data "
                        f"is spread over ranks, with no single storage, device buffer or C++ tensor); use "
                        f".local / .locals for this rank's shards, or .full() for the gathered tensor")
    raise AttributeError(f"'DistTensor' object has no attribute {name!r}")


def _is_op_name(name) -> bool:
    """A Tensor method that is one of paddle's ops (also a public function of paddle or paddle.linalg);
    the others (``data_ptr``, ``cuda``, ``get_tensor``...) act on a single local storage."""
    import paddle.linalg

    base = name[:-1] if name.endswith("_") else name
    return any(callable(getattr(m, base, None)) for m in (paddle, paddle.linalg, paddle.nn.functional))


DistTensor.__getattr__ = _dist_getattr
