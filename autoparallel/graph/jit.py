"""``paddle.jit.to_static`` over functions and layers that hold distributed tensors.

The article's static-mode snippet decorates a training step with paddle's own decorator::

    @paddle.jit.to_static
    def train_step(data):
        with auto_parallel.parallel_guard(["data"]):
            logits = model(data)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, labels))
        return loss

Paddle's translators alone cannot run autoparallel's layouts: the bytecode translator (SOT) stops in
autoparallel's own Python, and the AST translator feeds ``pir.Value`` placeholders, which carry no layout,
into the routed ops. So ``install()`` (run with dispatch's) puts a check in front of paddle's
``StaticFunction.__call__``. A decorated function that touches distributed tensors — an argument, the layer
it is a method of, or a layer / tensor its code names through globals or closure cells — is **lowered**:

* its first call builds one paddle static program for this rank (paddle's AST translator, ``full_graph``,
  over a wrapper with the function's signature; autoparallel's own modules are left untranslated);
* while the program is built, dispatch runs as in eager mode on DistTensors whose locals are program values:
  a layer's distributed parameter holds its program value as its local shard (its layout and its eager
  gradient convention kept: a replicated parameter's gradient stays a partial sum that the data-parallel
  runtime or ZeRO reduces at the step), a plain value next to distributed ones becomes a replicated one, ``shard_tensor`` / ``parallel_guard`` slice program
  values, every routed op adds its local op, and every collective of the plan becomes a static PyLayer
  (forward collective, backward its adjoint) — so the program holds this rank's local ops plus the
  collectives of the completed plan, and paddle's executor runs it (in program order when there are
  several ranks, so every rank issues its collectives in one order);
* distributed outputs leave the program as their local values and are wrapped again (a distributed loss:
  ``loss.backward()`` runs the program's backward, parameters get their gradients, the optimizer steps).

Later calls with the same input shapes run the built program: no Python dispatch at all.

Where no per-rank program exists — the simulated world (every rank in one process) — or paddle cannot build
it (data-dependent Python control flow, an op without a static kernel...), the function runs as written in
dygraph mode through autoparallel's dispatch, and says so once per function with a one-line
``UserWarning`` naming the reason; it then equals eager by construction. Functions over plain tensors are
translated by paddle exactly as before.

If a distributed tensor still reaches a routed op while paddle builds a static program outside lowering (a
model the check cannot see, e.g. reached through an attribute of a global object), ``check_static_call``
raises a ``NotImplementedError`` naming the op instead of computing on one shard's placeholder.

``ap.to_static(model, loader, loss_fn, optimizer)`` is the project's captured-graph mode (layouts
completed over the whole graph, then pinned, executed eagerly); ``docs/static.md`` compares step times.
"""
from __future__ import annotations

import contextlib
import warnings

from autoparallel import compat, patches
from autoparallel.compat import SideData
from autoparallel.graph.jit_reach import dygraph_reason, touches_dist

_INSTALLED = False
_NOTICED: set = set()
from autoparallel.context import state as _ctx  # noqa: E402  (lowering_depth > 0 while a program is built)
NOTICE = ("paddle.jit.to_static: {name} uses distributed tensors and runs in dygraph mode through autoparallel's "
          "dispatch, not as a paddle static program: {why}")


# a decorated function known to reach distributed tensors -> {"lowered": _Lowered or None, "why": reason it runs
# in dygraph or None}; the per-rank programs autoparallel built itself (never lowered again)
_STATE = SideData()
_LOWERED = SideData()


def lowering_state(static_function):
    """``{"lowered": ..., "why": ...}`` of a ``paddle.jit.to_static`` function autoparallel ran over distributed
    tensors (``why`` is None when it was lowered to a per-rank program), or None."""
    return _STATE.get(static_function)


def install() -> None:
    """Wrap ``StaticFunction.__call__`` (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from paddle.jit.dy2static.program_translator import StaticFunction

    orig = StaticFunction.__call__

    def __call__(self, *args, **kwargs):
        if not compat.to_static_enabled(self):     # paddle.jit.enable_to_static(False): dygraph, as paddle
            return orig(self, *args, **kwargs)
        if self in _STATE:                               # known to reach distributed tensors
            return _run(self, args, kwargs)
        if self in _LOWERED or compat.is_static_property(self) or \
                not touches_dist(self, args, kwargs):
            return orig(self, *args, **kwargs)
        return _run(self, args, kwargs)

    __call__.__wrapped__ = orig
    patches.patch(StaticFunction, "__call__", __call__)
    _install_param_conversion()
    _INSTALLED = True


def _notice(sf, why: str) -> None:
    fn = compat.dygraph_function(sf)
    key = getattr(fn, "__code__", None) or id(sf)
    if key in _NOTICED:
        return
    _NOTICED.add(key)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    warnings.warn(NOTICE.format(name=name, why=why), UserWarning, stacklevel=4)


# ---- static values entering autoparallel -------------------------------------------------------------------
def is_static_value(x) -> bool:
    """A ``pir.Value``: a placeholder of the static program paddle is building."""
    import paddle

    return isinstance(x, paddle.pir.Value)


def shard_value(value, mesh, placements, dtype=None, stop_gradient=None):
    """``shard_tensor`` while paddle builds a static program: this rank's slice of a program value (an eager
    tensor or array becomes a program constant first), as a DistTensor whose local is a program value."""
    import numpy as np
    import paddle

    from autoparallel.comm.world import current_world
    from autoparallel.dist_tensor import DistTensor, _local_from_full, _spec_for
    from autoparallel.spec import normalize_dtype

    if not _ctx.lowering_depth:
        raise NotImplementedError("shard_tensor while paddle builds a static program: decorate a function that "
                                  "names the model (it is then lowered by autoparallel), or call shard_tensor "
                                  "outside paddle.jit.to_static")
    if isinstance(value, paddle.Tensor):
        value = compat.convert_into_value(value)
    elif not is_static_value(value):
        value = paddle.to_tensor(np.asarray(value), dtype=dtype)
    shape = list(value.shape)
    if any(int(d) < 0 for d in shape):
        raise NotImplementedError(f"shard_tensor of a static-program value needs a fully known shape, got {shape}: "
                                  f"call the decorated function with concrete tensors (no dynamic InputSpec dims)")
    if dtype is not None and normalize_dtype(value.dtype) != normalize_dtype(dtype):
        value = value.astype(normalize_dtype(dtype))
    spec = _spec_for(shape, value.dtype, mesh, placements)
    world = current_world()
    locals_ = {r: _local_from_full(value, spec, r) for r in world.local_ranks(mesh.process_ids)}
    for v in locals_.values():
        v.stop_gradient = value.stop_gradient if stop_gradient is None else stop_gradient
    return DistTensor(locals_, spec)


# ---- lowering: a per-rank paddle static program ----------------------------------------------------------------
def _run(sf, args, kwargs):
    """Run a decorated function over distributed tensors: lowered (real ranks), else dygraph with a notice."""
    from autoparallel.comm.world import current_world

    state = _STATE.get(sf)
    if state is None:
        state = {"lowered": None, "why": dygraph_reason(sf, args, kwargs, current_world().is_simulated)}
        _STATE.set(sf, state)
    if state["why"] is None:
        try:
            if state["lowered"] is None:
                try:
                    state["lowered"] = Lowered(sf)
                except (TypeError, ValueError) as e:        # e.g. a callable without a Python signature
                    raise _CannotLower(f"cannot wrap it for paddle ({type(e).__name__}: {_last_line(e)})") from e
            return state["lowered"](args, kwargs)
        except _CannotLower as e:
            state["why"] = str(e)
    _notice(sf, state["why"])
    return compat.call_dygraph(sf, *args, **kwargs)


class _CannotLower(Exception):
    pass


_IGNORED: list = []


def _ignore_own_modules() -> None:
    """paddle's AST translator must call autoparallel's code as plain Python, never rewrite it.

    paddle skips a function whose file lies under an ignored module's directory (``__init__.py`` stripped), then
    looks for C bindings among every member reachable from each ignored module, a walk cached per module in an
    LRU of 128 entries. Each of the three packages is therefore handed over as one stand-in module carrying only
    the package's ``__file__``: the directory test covers every function of every submodule, loaded now or later,
    and there is nothing to walk (no C bindings here). Each submodule instead (200+) thrashed that LRU: every
    converted call walked all of paddle once per submodule (docs/static.md)."""
    import sys
    import types

    import paddle

    if _IGNORED:
        return
    for root in ("autoparallel", "spmd_rules", "reshard"):
        stand_in = types.ModuleType(root + " (files only)")
        stand_in.__file__ = sys.modules[root].__file__
        _IGNORED.append(stand_in)
    paddle.jit.ignore_module(list(_IGNORED))


class Lowered:
    """A decorated function over distributed tensors as one paddle static program per rank: dispatch runs
    while paddle's AST translator builds the program, so each routed op contributes its local op and the
    collectives of its plan on this rank's shards (DistTensors whose locals are the program's values);
    distributed outputs leave the program as their local values and are wrapped again after it ran."""

    def __init__(self, sf):
        import paddle

        _ignore_own_modules()
        _ordered_collectives()
        self.sf = sf
        self.fn = sf.dygraph_function                   # bound to its layer for a decorated method
        self.out_specs = {}                             # input signature -> (output tree, output specs)
        self._key = None
        spec = compat.input_spec_of(sf)       # the user's input_spec, if any, still applies
        self.program = paddle.jit.to_static(_same_signature(self.fn, self._inner), input_spec=spec, full_graph=True)
        _LOWERED.set(self.program, True)

    def _inner(self, *args, **kwargs):
        from autoparallel.dist_tensor import DistTensor

        _ctx.lowering_depth += 1
        outer = _ctx.lowering_swapped
        _ctx.lowering_swapped = {}
        try:
            with _value_methods():
                out = self.fn(*args, **kwargs)
        finally:
            _ctx.lowering_depth -= 1
            for param, locals_ in _ctx.lowering_swapped.values():      # the parameters hold their shards again
                param._ap_locals = locals_
            _ctx.lowering_swapped = outer
        flat, treedef = _flatten(out)
        specs = [x.spec if isinstance(x, DistTensor) else None for x in flat]
        self.out_specs[self._key] = (treedef, specs)
        return [x.local if isinstance(x, DistTensor) else x for x in flat]

    def __call__(self, args, kwargs):
        from autoparallel.dist_tensor import DistTensor

        self._key = _signature(args, kwargs)
        try:
            flat = self.program(*args, **kwargs)
        except Exception as e:                          # noqa: BLE001  (any translation failure: run dygraph)
            self.error = e
            raise _CannotLower(f"lowering failed ({type(e).__name__}: {_last_line(e)})") from e
        treedef, specs = self.out_specs[self._key]
        flat = flat if isinstance(flat, (list, tuple)) else [flat]
        outs = [x if spec is None else DistTensor({_rank(spec): x}, spec) for x, spec in zip(flat, specs)]
        return _unflatten(treedef, outs)


def _same_signature(fn, target):
    """A function with ``fn``'s parameter list calling ``target`` (paddle reads the decorated signature)."""
    import inspect

    sig = inspect.signature(fn)
    params, call, defaults = [], [], {}
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            params.append(f"*{p.name}")
            call.append(f"*{p.name}")
            continue
        if p.kind is p.VAR_KEYWORD:
            params.append(f"**{p.name}")
            call.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not any(x.startswith("*") for x in params):
            params.append("*")
        text = p.name
        if p.default is not p.empty:
            defaults[p.name] = p.default
            text += f"=__defaults[{p.name!r}]"
        params.append(text)
        call.append(p.name if p.kind is p.POSITIONAL_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
                    else f"{p.name}={p.name}")
    import linecache

    src = f"def lowered({', '.join(params)}):\n    return __target({', '.join(call)})\n"
    filename = f"<autoparallel lowered {getattr(fn, '__qualname__', 'function')} {id(target)}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)     # paddle reads the source
    scope = {"__target": target, "__defaults": defaults}
    exec(compile(src, filename, "exec"), scope)          # noqa: S102  (a signature, no user text)
    return scope["lowered"]


def _install_param_conversion() -> None:
    """While paddle swaps a layer's parameters for program values (``param_guard``), a distributed parameter
    stays itself inside lowering, its local shard swapped for its program value until the program is built:
    dispatch keeps its layout and treats it exactly as in eager mode (a replicated parameter's gradient stays a
    partial sum, reduced by the data-parallel runtime or ZeRO at the step, as eager gradients are). Outside
    lowering it is refused (a program over one shard's placeholder would compute silently wrong)."""
    owner, name = compat.static_value_converter()
    orig = getattr(owner, name)
    if getattr(orig, "_ap_wrapped", False):
        return

    def convert(tensor):
        from autoparallel.comm.world import current_world
        from autoparallel.dist_tensor import is_dist

        if not is_dist(tensor):
            return orig(tensor)
        if not _ctx.lowering_depth:
            raise NotImplementedError(f"paddle is building a static program over the distributed parameter "
                                      f"{tensor.name} (layout {tensor.spec}) outside autoparallel's lowering: "
                                      f"{_HIDDEN}")
        value = orig(tensor)
        if id(tensor) not in _ctx.lowering_swapped:
            _ctx.lowering_swapped[id(tensor)] = (tensor, tensor._ap_locals)
            tensor._ap_locals = {current_world().rank: value}
        return tensor

    convert._ap_wrapped = True
    patches.patch(owner, name, convert)


_HIDDEN = ("decorate a function that names the model or its inputs directly (as a global, a closure variable "
           "or an argument), so autoparallel lowers it, or use ap.to_static(model, loader, loss_fn, optimizer)")


class _ValueFns(dict):
    """dispatch's cache of local callables, seen while lowering: a ``paddle.Tensor`` method called on a
    program value runs the value's own method."""

    def get(self, path, default=None):
        fn = dict.get(self, path, default)
        if not path.startswith("paddle.Tensor."):
            return fn
        if fn is None:
            from autoparallel import dispatch

            fn = dispatch._ORIG.get(path) or dispatch._resolve(path)
        return _value_aware(fn, path.rsplit(".", 1)[1])


def _value_aware(fn, attr):
    import paddle

    def call(self, *args, **kwargs):
        if isinstance(self, paddle.pir.Value):
            return getattr(paddle.pir.Value, attr)(self, *args, **kwargs)
        return fn(self, *args, **kwargs)
    return call


@contextlib.contextmanager
def _value_methods():
    from autoparallel import dispatch

    prev = dispatch._LOCAL_FN
    dispatch._LOCAL_FN = _ValueFns(prev)
    try:
        yield
    finally:
        prev.update({k: v for k, v in dict.items(dispatch._LOCAL_FN) if k not in prev})
        dispatch._LOCAL_FN = prev


def static_comm(xs, fwd, bwd):
    """A collective inside a program being lowered: ``fwd`` on this rank's tensors as a static PyLayer whose
    backward is ``bwd`` (the adjoint collective), built when paddle differentiates the program."""
    import paddle

    order = list(xs)
    ts = [xs[r] for r in order]
    if all(t.stop_gradient for t in ts):
        with paddle.no_grad():
            return fwd(dict(xs))
    from paddle.jit.dy2static.py_layer import StaticPyLayer

    outs = StaticPyLayer(_comm_layer(fwd, bwd, order)).apply(*ts)
    return dict(zip(order, outs if isinstance(outs, (list, tuple)) else [outs]))   # one output comes bare


def _comm_layer(fwd, bwd, order):
    """A PyLayer class over ``len(order)`` tensors (a fixed arity: paddle binds the forward's signature)."""
    import linecache

    from paddle.autograd import PyLayer

    n = len(order)
    names = ", ".join(f"t{i}" for i in range(n))
    src = (f"class _StaticComm(PyLayer):\n"
           f"    @staticmethod\n"
           f"    def forward(ctx, {names}):\n"
           f"        outs = __fwd(dict(zip(__order, [{names}])))\n"
           f"        return tuple(outs[r] for r in __order)\n"
           f"    @staticmethod\n"
           f"    def backward(ctx, {names}):\n"
           f"        outs = __bwd(dict(zip(__order, [{names}])))\n"
           f"        return tuple(outs[r] for r in __order)\n")
    filename = f"<autoparallel static collective {id(fwd)}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    scope = {"PyLayer": PyLayer, "__fwd": fwd, "__bwd": bwd, "__order": order, "__name__": __name__}
    exec(compile(src, filename, "exec"), scope)          # noqa: S102  (generated from a count, no user text)
    return scope["_StaticComm"]


def _signature(args, kwargs):
    """What paddle keys its programs by, as far as the outputs' layouts go: tensor shapes and dtypes, other
    values by repr."""
    import paddle

    def key(v):
        if isinstance(v, paddle.Tensor):
            return ("t", tuple(v.shape), str(v.dtype))
        if isinstance(v, (list, tuple)):
            return tuple(key(u) for u in v)
        return repr(v)
    return key(list(args)), tuple(sorted((k, key(v)) for k, v in kwargs.items()))


def _ordered_collectives() -> None:
    """Every rank must issue its collectives in one order; paddle's executor may run independent ops of a
    program in any order on several threads, so with more than one rank it runs them in program order."""
    import paddle

    from autoparallel.comm.world import current_world

    if current_world().world_size > 1:
        paddle.set_flags({"FLAGS_new_executor_sequential_run": True, "FLAGS_new_executor_serial_run": True})


def _last_line(e) -> str:
    """The message of an error paddle's translator re-raised with its own header (the last line says it)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:200]


def _rank(spec) -> int:
    from autoparallel.comm.world import current_world

    return current_world().rank


def _flatten(out):
    if isinstance(out, (list, tuple)):
        parts = [_flatten(o) for o in out]
        return [x for p, _ in parts for x in p], (type(out), [len(p) for p, _ in parts], [t for _, t in parts])
    return [out], None


def _unflatten(treedef, flat):
    if treedef is None:
        return flat[0]
    kind, sizes, subs = treedef
    out, i = [], 0
    for n, sub in zip(sizes, subs):
        out.append(_unflatten(sub, flat[i:i + n]))
        i += n
    return kind(out)


def static_args(op: str, args, kwargs):
    """Called by dispatch on a routed op over distributed tensors in static-graph mode: while a Lowered
    function builds its program, plain program values next to distributed ones become replicated
    DistTensors (as plain tensors are in eager mode); otherwise the call is refused."""
    if _ctx.lowering_depth:
        mesh = _mesh_of(args, kwargs)
        return tuple(_wrap_value(a, mesh) for a in args), {k: _wrap_value(v, mesh) for k, v in kwargs.items()}
    check_static_call(op)
    return args, kwargs


def _mesh_of(args, kwargs):
    from autoparallel.dist_tensor import as_dist, is_dist

    for v in list(args) + list(kwargs.values()):
        for u in (v if isinstance(v, (list, tuple)) else (v,)):
            if is_dist(u):
                return as_dist(u).mesh
    return None


def _wrap_value(v, mesh):
    from autoparallel.comm.world import current_world
    from autoparallel.dist_tensor import DistTensor
    from autoparallel.placement import Replicate
    from autoparallel.spec import DistSpec

    if isinstance(v, (list, tuple)):
        return type(v)(_wrap_value(u, mesh) for u in v)
    if mesh is None or not is_static_value(v):
        return v
    spec = DistSpec(mesh, tuple(Replicate() for _ in range(mesh.ndim)), tuple(int(d) for d in v.shape), v.dtype)
    return DistTensor({r: v for r in current_world().local_ranks(mesh.process_ids)}, spec)


def check_static_call(op: str) -> None:
    """Refuse a routed op over distributed tensors while paddle builds a static program outside lowering."""
    import paddle

    if not paddle.in_dynamic_mode() and not _ctx.lowering_depth:
        raise NotImplementedError(f"{op} received distributed tensors while paddle builds a static program "
                                  f"outside autoparallel's lowering: {_HIDDEN}")
