"""Op interception: a paddle op that receives a DistTensor or DistParameter runs through its spmd rule.

    rule(input specs) -> reshard inputs to what the rule requires -> local paddle op on every held rank
    -> DistTensor outputs with the rule's output specs

Routing covers every dotted path in ``spmd_rules.op_table.OP_TABLE`` plus the places paddle's layers
imported those functions into (``paddle.nn.layer.norm.layer_norm`` ...). The remaining public callables
of ``paddle``, ``paddle.nn.functional``, ``paddle.linalg`` and the math methods of ``paddle.Tensor`` are
guarded: given a distributed tensor they raise ``NotImplementedError`` naming the op and
``register_spmd_rule``. Plain tensors pay one isinstance scan. While a local op runs (``local_mode``)
nothing is routed, so paddle's own code inside an op sees plain tensors.

This module is the call path. Installing the routing (and undoing it) is ``dispatch_install`` behind the
handle of ``dispatch_handle``; layouts pinned op by op are ``dispatch_pins``; DistTensor's own op methods are
generated in ``dist_tensor_ops``.
"""
from __future__ import annotations

import paddle
from spmd_rules import get_spmd_rule, has_spmd_rule
from spmd_rules.op_table import ARG_MAP, OP_TABLE
from spmd_rules.errors import DataDependentShapeError
from spmd_rules.registry import flatten_specs, replace_specs
from spmd_rules.result import LocalShaped

from autoparallel import (binding, cross_mesh_grad, dispatch_cache, dispatch_handle, local_ops, read_value,
                          view_alias)
from autoparallel.comm import fanout
from autoparallel.comm.world import current_world
from autoparallel.compat import EagerParamBase, building_static_program, owner_of, resolve
from autoparallel.context import state as _ctx
from autoparallel.dispatch_empty import empty_operands, empty_safe
from autoparallel.dispatch_pre import OPERATOR_PATHS, PRE_STEPS, map_args, numpy_operands, pre_step
from autoparallel.dispatch_pins import PinnedLayouts, pinned, replayable  # noqa: F401  (re-exported)
from autoparallel.dist_tensor import DistParameter, DistTensor, as_dist
from autoparallel.dispatch_values import VALUE_OPS, resolve as resolve_values
from autoparallel import dist_tensor_forms as _forms
from autoparallel.dist_tensor_forms import gather_released_leaves
from autoparallel.local_mode import in_local_mode, local_mode  # noqa: F401  (re-exported)
from autoparallel.param_detach import detached_param
from autoparallel.placement import Replicate
from autoparallel.shadows import SHADOWS, has_shadow, unshadow
from autoparallel.spec import DistSpec, normalize_dtype

_ORIG: dict = {}          # dotted path -> original callable


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
    return SHADOWS[0] and has_shadow(args, kwargs)


def _tracing_tensors(args, kwargs) -> bool:
    """While tracing, ops on (possibly lazy, unallocated) parameters are recorded too — in eager runs those
    parameters are distributed, so the traced op sequence is the eager one; constants are computed."""
    if _ctx.tracer is None:
        return False
    return any(isinstance(v, EagerParamBase) for v in flatten_specs(args, kwargs, is_leaf=_is_tensor_leaf))


def _is_tensor_leaf(v) -> bool:
    return isinstance(v, (DistTensor, paddle.Tensor))


def _is_spec(v) -> bool:
    return isinstance(v, DistSpec)


# ---- the routed call ------------------------------------------------------------------------------------------
def run(op: str, path: str, args, kwargs):
    """Run paddle callable ``path`` (rule ``op``) on distributed arguments (see _run); reads of a tensor made
    stale by a write through a view are refused, and view ops' outputs are linked to their input."""
    if view_alias.any_stale():
        view_alias.check_reads(op, _shallow_leaves(args, kwargs))
    if op in PRE_STEPS:
        args, kwargs = pre_step(op, _ORIG.get(path), args, kwargs)
    if path in OPERATOR_PATHS:
        args = numpy_operands(args)
    out = _run(op, path, args, kwargs)
    view_alias.record(op, args, out, DistTensor)
    if cross_mesh_grad.LIVE[0]:         # outputs name the cross-mesh moves they depend on
        cross_mesh_grad.carry(args, kwargs, out)
    return out


def _shallow_leaves(args, kwargs) -> list:
    vals = list(args) + list(kwargs.values())
    return vals + [u for v in vals if isinstance(v, (list, tuple)) for u in v]


def _run(op: str, path: str, args, kwargs):
    """Run paddle callable ``path`` (rule ``op``) on distributed arguments.

    A call whose key (see dispatch_cache) was seen before reuses its plan: no rule, no validation, no
    reshard planning; only the data-dependent steps run. A call written as one before is looked up as
    written, before binding (``dispatch_cache.Rebind``): its bound form is rebuilt from a recipe."""
    if op in VALUE_OPS:                  # tensors standing for numbers (x.expand([-1, w])): read their values
        args, kwargs = resolve_values(op, args, kwargs)
    written = _written(op, path, args, kwargs)
    if written is not None:
        hit = dispatch_cache.find_written(written[0])
        if hit is not None:
            plan, rebind = hit
            a, k, leaves = rebind.apply(args, kwargs, written[1])
            return _run_plan(op, path, plan, leaves, a, k)
    wargs, wkwargs = args, kwargs
    if building_static_program():                        # paddle.jit.to_static building a program
        from autoparallel.graph.jit import static_args
        args, kwargs = static_args(op, args, kwargs)
    if SHADOWS[0]:
        args, kwargs = unshadow(args, kwargs)
    args, kwargs = _bind(op, path, tuple(args), dict(kwargs))
    if path in ARG_MAP:
        args, kwargs = map_args(path, args, kwargs)
    rule = get_spmd_rule(op)
    tracer = _ctx.tracer
    if tracer is not None:
        return _run_traced(op, rule, args, kwargs, tracer)
    leaves = []
    args_key = dispatch_cache.call_key(args, kwargs, leaves)
    if args_key is None:
        leaves = _leaves(args, kwargs)
    world = current_world()
    pins = _ctx.pinned
    pinned_res = None
    if pins is not None:
        mesh = _common_mesh(op, leaves)
        pinned_res = pins.next(op, [_to_dist(v, mesh).spec for v in leaves])
    key, plan = dispatch_cache.find(rule, path, world, args_key, pinned_res)
    if plan is not None:
        if written is not None:
            dispatch_cache.store_written(written, plan, (wargs, wkwargs), (args, kwargs, leaves))
        return _run_plan(op, path, plan, leaves, args, kwargs)
    plan = _plan_call(op, rule, args, kwargs, leaves, pinned_res, world)
    gather_released_leaves(leaves)
    outs = _execute(op, path, plan.res, plan.mesh, plan.calls(leaves, args, kwargs))
    check_outputs(op, plan, outs)           # once per call signature: the plan is cached only when it holds
    dispatch_cache.store(key, plan)
    if written is not None and key is not None:
        dispatch_cache.store_written(written, plan, (wargs, wkwargs), (args, kwargs, leaves))
    out = _wrap(plan.res, outs, plan.held)
    if plan.derives is not None:
        fanout.note_derived(out, leaves[plan.derives])
    return out


def _written(op, path, args, kwargs):
    """``(key, tensor leaves)`` of the call as written (dispatch_cache.written_key), or None where the
    bound call is not a function of that key alone: pinned layouts (each call takes the next pin), shadows,
    tracing, static programs, custom ops (looked up anew)."""
    if _ctx.tracer is not None or _ctx.pinned is not None or SHADOWS[0] or path.startswith("custom.") \
            or building_static_program():
        return None
    leaves = []
    key = dispatch_cache.written_key(get_spmd_rule(op), path, current_world(),
                                     dispatch_cache.call_key(args, kwargs, leaves))
    return None if key is None else (key, leaves)


def _run_plan(op, path, plan, leaves, args, kwargs):
    """Run a cached plan on this call's values."""
    gather_released_leaves(leaves)
    out = _wrap(plan.res, _execute(op, path, plan.res, plan.mesh, plan.calls(leaves, args, kwargs)), plan.held)
    if plan.derives is not None:        # a cast / view of a parameter (dispatch_cache.DATA_FREE)
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
        raise type(e)(f"spmd rule {op!r} failed on inputs {_specs_str(specs)}: {e}{_split_size_hint(specs)}") from e


def _split_size_hint(specs) -> str:
    """On a failed rule only: when two inputs disagree in a dim where one size is the other split over a mesh dim,
    the smaller tensor was most likely sized from a split parameter's local ``.shape`` (a layer built or wrapped
    after the model was parallelized, e.g. an adapter added by a PEFT library)."""
    ways = {n for sp in specs for n in sp.mesh.shape if n > 1}
    for a in specs:
        for b in specs:
            for x, y in zip(reversed(a.shape), reversed(b.shape)):
                if x > y and any(-(-x // n) == y for n in ways):
                    return (f" (size {y} is {x} split {x // y} ways: a distributed parameter's .shape is its local "
                            f"shard, so a layer or tensor sized from it after parallelizing holds a piece of the "
                            f"global size; build or wrap the model (adapters included) before ap.parallelize / "
                            f"shard_layer)")
    return ""


def _run_traced(op, rule, args, kwargs, tracer):
    leaves = _leaves(args, kwargs)
    mesh = _common_mesh(op, leaves, tracer)
    dists = [_to_dist(v, mesh, tracer) for v in leaves]
    spec_args, spec_kwargs = replace_specs(args, kwargs, [d.spec for d in dists], is_leaf=_is_tensor_leaf)
    pins = _ctx.pinned
    res = pins.next(op, [d.spec for d in dists]) if pins is not None else None
    if res is None:
        res = rule(*spec_args, **spec_kwargs)
    return _trace(tracer, op, dists, res)


def _trace(tracer, op, dists, res):
    """Record the op and return spec-only outputs (nothing is computed)."""
    if any(s.__class__ is LocalShaped for s in res.outputs):
        raise DataDependentShapeError(f"{op}: its output size depends on the values, which graph tracing "
                                      f"(ap.trace, ModelSpec.from_trace, auto_mode='full') does not compute; give "
                                      f"the degrees yourself (auto_mode='semi', which runs eagerly) or keep {op} "
                                      f"outside the traced region")
    reshards = [fanout.reshard_plan(d.spec, req) for d, req in zip(dists, res.inputs) if d.spec != req]
    outs = [None if s is None else DistTensor({}, s) for s in res.outputs]
    node = tracer.record(op, dists, res.inputs, res.outputs, reshards)
    for o in outs:
        if o is not None:
            tracer.producer[id(o)] = node
    return outs[0] if len(outs) == 1 else tuple(outs)


def _leaves(args, kwargs) -> list:
    return flatten_specs(args, kwargs, is_leaf=_is_tensor_leaf)


def _common_mesh(op, leaves, tracer=None):
    meshes = {x.mesh if isinstance(x, DistTensor) else x._ap_spec.mesh for x in leaves if is_dist(x)}
    if not meshes and tracer is not None:
        return tracer.mesh
    if len(meshes) > 1:                          # the same ranks under other dim names (a loader's ["dp", "mp"])
        first = next(x.mesh if isinstance(x, DistTensor) else x._ap_spec.mesh for x in leaves if is_dist(x))
        if all(_forms.same_ranks(m, first) for m in meshes):
            return first
    if len(meshes) != 1:
        raise ValueError(f"{op}: every distributed input must live on one mesh; got tensors on "
                         f"{sorted(str(m) for m in meshes)} — reshard them onto one mesh first")
    return next(iter(meshes))


def _to_dist(v, mesh, tracer=None) -> DistTensor:
    if is_dist(v):
        if tracer is not None:
            return DistTensor({}, as_dist(v).spec) if not isinstance(v, DistTensor) else v
        d = as_dist(v)
        return d if d.spec.mesh is mesh or d.spec.mesh == mesh else _forms.same_ranks_view(d, mesh)
    if tracer is not None:                      # spec only: a (possibly lazy, unallocated) parameter or constant
        spec = tracer.param_specs.get(id(v)) or DistSpec(mesh, tuple(Replicate() for _ in range(mesh.ndim)),
                                                         tuple(v.shape), v.dtype)
        return DistTensor({}, spec)
    owner = detached_param(v)
    if owner is not None:                       # p.detach() of a distributed parameter: its global value
        return _detached_view(owner, mesh)
    # a plain tensor next to distributed ones: the same value on every rank (replicated)
    spec = DistSpec(mesh, tuple(Replicate() for _ in range(mesh.ndim)), tuple(v.shape), v.dtype)
    return DistTensor({r: v for r in current_world().local_ranks(mesh.process_ids)}, spec)


def _detached_view(p, mesh) -> DistTensor:
    if p._ap_spec.mesh != mesh:
        raise ValueError(f"the detach() of distributed parameter {p.name} lives on mesh {p._ap_spec.mesh}, the "
                         f"other distributed inputs on {mesh}; reshard it onto one mesh first")
    return DistTensor({r: t.detach() for r, t in p._ap_locals.items()}, p._ap_spec)


def _execute(op, path, res, mesh, calls) -> dict:
    _ctx.local_depth += 1        # local_mode(), without a generator
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
            if ARG_MAP.get(path) in ("swap", "swap_scalar_1d"):       # back to the reflected operator's order
                calls = {r: ((a[1], a[0]) + tuple(a[2:]), k) for r, (a, k) in calls.items()}
            if op in _CONTRACTING:
                calls = {r: (empty_operands(a), k) for r, (a, k) in calls.items()}
        return {r: _as_tuple(empty_safe(op, fn, a)(*a, **k)) for r, (a, k) in calls.items()}
    finally:
        _ctx.local_depth -= 1


_CONTRACTING = {"matmul", "linear", "bmm"}


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
    if dispatch_handle.installed() and not path.startswith("custom."):
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
        return read_value.settle(DistTensor._own({r: outs[r][0] for r in held}, spec))
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


# ---- paths and custom ops --------------------------------------------------------------------------------------
def _resolve(path):
    return resolve(path)


def _owner(path):
    return owner_of(path)


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


def routed_form(fn):
    """The routed wrapper of an original paddle function (one taken before dispatch was installed, e.g.
    ``loss_fn=F.cross_entropy``), or ``fn`` itself."""
    for path, orig in _ORIG.items():
        if orig is fn:
            return resolve(path)
    return fn


def install():
    """Route paddle ops on distributed tensors (idempotent); returns the handle (see dispatch_handle)."""
    return dispatch_handle.install()


def uninstall(force: bool = False) -> int:
    """Put back every paddle name dispatch patched (see dispatch_handle)."""
    return dispatch_handle.uninstall(force)
