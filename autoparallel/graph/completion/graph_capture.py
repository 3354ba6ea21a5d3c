"""Step 1, capture: the forward (and loss) op graph with each op's rule call, input sources and layer."""
from __future__ import annotations

import contextlib

import networkx as nx

from autoparallel.graph.completion.errors import AnnotationConflictError, MissingRuleError
from autoparallel.graph.completion.sources import Source
from autoparallel.placement import Replicate, format_placements, parse_placements
from autoparallel.spec import DistSpec, input_shape_dtype


class _Producers(dict):
    """dispatch's ``tracer.producer`` map, also remembering which output slot each tensor is."""

    def __init__(self, tracer):
        super().__init__()
        self.tracer = tracer

    def __setitem__(self, key, node):
        super().__setitem__(key, node)
        self.tracer._note_output(key, node)


def _make_tracer(param_specs, mesh):
    from autoparallel.graph.trace import Tracer

    class CallTracer(Tracer):
        """ap.trace's tracer plus what completion needs: rule calls, input sources, layers."""

        def __init__(self):
            super().__init__(param_specs, mesh)
            self.producer = _Producers(self)
            self.out_slot = {}          # id(DistTensor) -> (node, slot)
            self.filled = {}            # node -> output slots seen so far
            self.inputs = {}            # id(DistTensor) -> model input index
            self.param_names = {}       # id(parameter) -> name
            self.pending_call = None
            self.pending_leaves = []
            self.layers = []
            self.keep = []              # keeps traced tensors alive, so their ids stay unique
            self.region = None          # the recompute region running (dispatch.replayable), if any
            self.regions = 0

        def _note_output(self, key, node):
            outs = self.graph.nodes[node]["outputs"]
            live = [k for k, s in enumerate(outs) if s is not None]
            n = self.filled.get(node, 0)
            self.filled[node] = n + 1
            self.out_slot[key] = (node, live[n])

        def record(self, op, inputs, required, outputs, reshards):
            node = super().record(op, inputs, required, outputs, reshards)
            leaves, self.pending_leaves = self.pending_leaves, []
            call, self.pending_call = self.pending_call, None
            sources = []
            for k, d in enumerate(inputs):
                leaf = leaves[k] if k < len(leaves) else d
                sources.append(self._source(leaf, d))
            self.keep.append((inputs, leaves))
            data = self.graph.nodes[node]
            data["call"] = call[0] if call else ((), {})
            data["greedy"] = call[1] if call else None
            data["sources"] = tuple(sources)
            data["seen"] = tuple(d.spec for d in inputs)
            data["layer"] = self.layers[-1] if self.layers else ""
            data["recompute"] = self.region
            return node

        def _source(self, leaf, d):
            if leaf is d and id(d) in self.out_slot:
                node, slot = self.out_slot[id(d)]
                if self.graph.nodes[node]["outputs"][slot] == d.spec:      # not a reused id
                    return Source("op", node, slot)
            if leaf is d and id(d) in self.inputs:
                return Source("input", self.inputs[id(d)])
            name = self.param_names.get(id(leaf))
            if name is not None:
                return Source("param", name=name, spec=d.spec)
            return Source("const", spec=d.spec)

    return CallTracer()


class _RecordingRule:
    """Stands in for a rule during capture: records the spec arguments of the call and its result."""

    def __init__(self, rule, tracer):
        self._rule, self._tracer = rule, tracer

    def __call__(self, *args, **kwargs):
        res = self._rule(*args, **kwargs)
        self._tracer.pending_call = ((args, dict(kwargs)), res)
        return res

    def __getattr__(self, name):
        return getattr(self._rule, name)


@contextlib.contextmanager
def _recording(tracer):
    """Route dispatch's rule look-up and input conversion through ``tracer`` (capture only)."""
    from autoparallel import dispatch

    get_rule, to_dist = dispatch.get_spmd_rule, dispatch._to_dist

    def recording_get(op):
        return _RecordingRule(get_rule(op), tracer)

    def recording_to_dist(v, mesh, tr=None):
        d = to_dist(v, mesh, tr)
        tracer.pending_leaves.append(v)
        return d

    dispatch.get_spmd_rule, dispatch._to_dist = recording_get, recording_to_dist
    try:
        yield
    finally:
        dispatch.get_spmd_rule, dispatch._to_dist = get_rule, to_dist


@contextlib.contextmanager
def _layer_names(model, tracer):
    """Keep ``tracer.layers`` = the stack of sublayer names currently running."""
    handles = []
    for name, sub in model.named_sublayers(include_self=True):
        def pre(_l, _i, n=name or type(model).__name__):
            tracer.layers.append(n)

        def post(_l, _i, _o):
            if tracer.layers:
                tracer.layers.pop()

        handles.append(sub.register_forward_pre_hook(pre))
        handles.append(sub.register_forward_post_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _placements(mesh, value, what):
    try:
        pl = parse_placements(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"annotation for {what}: {e}") from None
    if len(pl) != mesh.ndim:
        raise ValueError(f"annotation for {what}: expected {mesh.ndim} placements (one per mesh dim "
                         f"{mesh.dim_names}), got {len(pl)}: {format_placements(pl)}")
    return pl


def _split_annotations(model, mesh, annotations):
    """(param name -> placements, layer name -> output placements) from a dict of names or TP styles."""
    from autoparallel.parallel.tensor_parallel import STYLES

    named = dict(model.named_parameters())
    layers = {n for n, _ in model.named_sublayers() if n}
    params, outputs, styles = {}, {}, {}
    for key, val in (annotations or {}).items():
        if isinstance(val, STYLES):
            styles[key] = val
        elif key in named:
            params[key] = _placements(mesh, val, f"parameter {key!r}")
        elif key in layers:
            outputs[key] = _placements(mesh, val, f"the output of layer {key!r}")
        else:
            raise ValueError(f"annotation key {key!r} names neither a parameter nor a sublayer of "
                             f"{type(model).__name__}; parameters include {sorted(named)[:8]}")
    if styles:
        from autoparallel.graph.trace import _param_specs

        by_id = _param_specs(model, mesh, styles)
        for name, p in named.items():
            spec = by_id[id(p)]
            if not spec.is_replicated() and name not in params:
                params[name] = spec.placements
    return params, outputs


def _input_spec(mesh, spec, i):
    """(seen DistSpec, fixed?) of model input ``i``: a DistSpec is fixed, (shape, dtype) or InputSpec free."""
    if isinstance(spec, DistSpec):
        if spec.mesh != mesh:
            raise ValueError(f"input {i} lives on mesh {spec.mesh.short()} but input 0 on {mesh.short()}")
        return spec, True
    shape, dtype = input_shape_dtype(spec, f"input {i}")
    return DistSpec(mesh, tuple(Replicate() for _ in range(mesh.ndim)), shape,
                    dtype or "float32"), False


def capture(model, *input_specs, loss_fn=None, n_model_inputs=None, annotations=None, mesh=None,
            free_inputs=False, hard_inputs=False) -> nx.DiGraph:
    """The forward (and loss) op graph of ``model``, with what completion needs on every node.

    ``input_specs``: a DistSpec per input (the layout the data arrives in, unless ``free_inputs``) or a
    ``(shape, dtype)`` / ``paddle.static.InputSpec`` (layout free). ``hard_inputs`` (a bool, or one per
    input) makes arrival layouts annotations: the first consumers take them as they are (data parallelism
    requested by a strategy). With ``loss_fn`` the model takes the
    first ``n_model_inputs`` (default: all but the last) and ``loss_fn(output, *rest)`` is captured too.
    ``annotations``: {parameter name: placements, sublayer name: output placements, pattern: TP style}.
    """
    from autoparallel import dispatch_handle
    from autoparallel.dist_tensor import DistTensor, is_dist
    from autoparallel.graph.trace import tracing

    if not input_specs:
        raise TypeError("capture needs at least one input spec")
    if mesh is None:
        firsts = [s for s in input_specs if isinstance(s, DistSpec)]
        if not firsts:
            raise TypeError("capture needs a mesh: pass mesh= or give at least one input as a DistSpec")
        mesh = firsts[0].mesh
    dispatch_handle.install()
    seen = [_input_spec(mesh, s, i) for i, s in enumerate(input_specs)]
    n_in = len(seen) - (1 if loss_fn is not None else 0) if n_model_inputs is None else int(n_model_inputs)
    if not 0 < n_in <= len(seen):
        raise ValueError(f"n_model_inputs must be in [1, {len(seen)}], got {n_in}")
    param_ann, out_ann = _split_annotations(model, mesh, annotations)
    named = dict(model.named_parameters())
    param_specs, fixed_params, trainable = {}, {}, {}
    for name, p in named.items():
        if is_dist(p):
            spec = p.spec
            if name in param_ann and tuple(param_ann[name]) != tuple(spec.placements):
                raise AnnotationConflictError(
                    f"parameter {name!r} is already distributed as {format_placements(spec.placements)} but "
                    f"annotated {format_placements(param_ann[name])}")
            fixed_params[name] = spec.placements
        else:
            pl = param_ann.get(name, tuple(Replicate() for _ in range(mesh.ndim)))
            spec = DistSpec(mesh, tuple(pl), tuple(p.shape), str(p.dtype))
            if name in param_ann:
                fixed_params[name] = tuple(pl)
        param_specs[id(p)] = spec
        trainable[name] = not p.stop_gradient
    tracer = _make_tracer(param_specs, mesh)
    tracer.param_names = {id(p): n for n, p in named.items()}
    ins = [DistTensor({}, s) for s, _ in seen]
    tracer.inputs = {id(t): i for i, t in enumerate(ins)}
    out_marks = []

    def mark(name, placements):
        def post(_l, _i, out):
            leaves = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, DistTensor)]
            out_marks.append((name, placements, leaves[0] if leaves else None))
        return post

    handles = [sub.register_forward_post_hook(mark(n, out_ann[n])) for n, sub in model.named_sublayers()
               if n in out_ann]
    try:
        with tracing(tracer), _recording(tracer), _layer_names(model, tracer):
            out = model(*ins[:n_in])
            n_model_ops = tracer.count
            loss = loss_fn(out, *ins[n_in:]) if loss_fn is not None else None
    except NotImplementedError as e:
        from spmd_rules.errors import DataDependentShapeError

        where = tracer.layers[-1] if tracer.layers else type(model).__name__
        hint = ("; a captured graph is built before any value is known, so a model whose shapes follow its data "
                "(mixture-of-experts routing) cannot be captured: run it eagerly with ap.parallelize"
                if isinstance(e, DataDependentShapeError) else "")
        raise MissingRuleError(f"inside the captured graph of {type(model).__name__} (layer {where!r}, after "
                               f"op #{tracer.count}): {e}{hint}") from e
    finally:
        for h in handles:
            h.remove()
    g = tracer.graph
    fixed_in = [f and not free_inputs for _, f in seen]
    hard = list(hard_inputs) if isinstance(hard_inputs, (list, tuple)) else [bool(hard_inputs)] * len(seen)
    if len(hard) != len(seen):
        raise ValueError(f"hard_inputs has {len(hard)} entries for {len(seen)} inputs")
    g.graph.update(mesh=mesh, inputs=[s for s, _ in seen], fixed_inputs=fixed_in,
                   hard_inputs=[f and h for f, h in zip(fixed_in, hard)],
                   n_model_inputs=n_in, n_model_ops=n_model_ops, fixed_params=fixed_params,
                   param_specs={n: param_specs[id(p)] for n, p in named.items()}, trainable=trainable,
                   out_annotations={}, model_outputs=_out_keys(tracer, out), loss=None,
                   param_uses={})
    if loss is not None:
        keys = _out_keys(tracer, loss)
        g.graph["loss"] = keys[0] if keys else None
    for name, pl, t in out_marks:
        if t is None or id(t) not in tracer.out_slot:
            raise ValueError(f"annotation for the output of layer {name!r}: that output is not produced by an op")
        g.graph["out_annotations"][tracer.out_slot[id(t)]] = (tuple(pl), name)
    for k, d in g.nodes(data=True):
        for i, s in enumerate(d["sources"]):
            if s.kind in ("param", "input"):
                g.graph["param_uses"].setdefault(s.key, []).append((k, i))
    _mark_grads(g)
    return g


def _out_keys(tracer, out):
    from autoparallel.dist_tensor import DistTensor

    leaves = out if isinstance(out, (tuple, list)) else (out,)
    return [tracer.out_slot[id(t)] for t in leaves if isinstance(t, DistTensor) and id(t) in tracer.out_slot]


def _mark_grads(g):
    """``needs_grad`` on every op output: some input needs a gradient and the output is floating point."""
    trainable = g.graph["trainable"]
    for k in sorted(g.nodes):
        d = g.nodes[k]
        need = False
        for s in d["sources"]:
            if s.kind == "op":
                need |= g.nodes[s.node]["needs_grad"][s.slot]
            elif s.kind == "param":
                need |= trainable.get(s.name, False)
        d["needs_grad"] = tuple(need and o is not None and o.dtype.startswith(("float", "bfloat"))
                                for o in d["outputs"])
