"""Whole-graph completion: every op's layout for a captured forward (and loss), chosen by total cost.

    plan = complete(model, DistSpec(mesh, [Replicate()], (8, 16)), annotations={"fc1.weight": "[S(1)]"})
    print(plan.listing())                  # per op: placements in and out, the collectives it causes
    with plan.pinned():                    # execution with these layouts (dispatch asks no rule)
        out = model(x)

The steps, in order:

1. **capture** runs the forward on spec-only tensors through dispatch (like ``ap.trace``) and records, per
   op, the rule call (spec arguments and attributes), where each input comes from (an op output, a model
   input, a parameter, a constant) and the sublayer that ran it.
2. **propagate**: forward rules (input layouts -> output layouts) and reverse rules (output -> inputs)
   run to a fixpoint from the user's annotations; every unknown tensor gets the first layout inferred.
3. **candidates**: for each op, the distinct rule results over input placements with one "driver" per
   mesh dim (one input sharded on one dim or partial, all others replicated), plus the propagated and the
   eager (greedy) result. Any rule result is a valid layout of the op: the runtime reshards its inputs to
   what the result requires.
4. **annotations are hard where they describe compute**: an annotated parameter is stored and consumed in its
   layout (a replicated one may still enter as Partial: that is local and free), an annotated layer output
   is produced in its layout; an op whose candidates all break some of these raises
   ``AnnotationConflictError`` naming them. A model input's layout is where the data arrives: its first
   consumers may reshard it, at a price — unless it is hard (``hard_inputs``: a strategy's data parallelism).
5. **cost** (seconds, cluster alpha-beta): compute ``3 x FLOPs`` split over the mesh dims the op shards,
   forward reshards, their backward adjoints for tensors needing gradients, the gradient all-reduce of a
   replicated input of a split op, and gradient reductions of parameters (bucketed: bandwidth only).
   An unannotated parameter used once is stored in the layout its consumer requires (Partial stored as
   Replicate); one used more than once, or a free input used more than once, is a variable of its own.
6. **solve** exactly: variables with at most two neighbours are eliminated by dynamic programming (chains
   and trees vanish completely, series-parallel graphs too); what remains, where the graph branches, is
   an integer program (scipy's HiGHS ``milp``, local-polytope formulation, exact with integral choices).
"""
from __future__ import annotations

import contextlib
import fnmatch
import itertools
from dataclasses import dataclass, field

import networkx as nx
import numpy as np
from spmd_rules import get_spmd_rule
from spmd_rules.registry import flatten_specs, replace_specs

from autoparallel.placement import Partial, Replicate, Shard, format_placements, parse_placements
from autoparallel.spec import DistSpec

__all__ = ["AnnotationConflictError", "MissingRuleError", "Source", "capture", "propagate", "candidates", "feasible",
           "complete_graph",
           "CostModel", "Problem", "solve", "exhaustive", "complete", "CompletedPlan", "build_problem"]


class AnnotationConflictError(ValueError):
    """User annotations that no layout of some op satisfies together."""


class MissingRuleError(NotImplementedError):
    """An op inside the captured graph has no spmd rule."""


# =====================================================================================================
# 1. capture
# =====================================================================================================
@dataclass(frozen=True)
class Source:
    """Where one input of an op comes from: ``kind`` is "op" (output ``slot`` of op ``node``), "input"
    (model input ``node``), "param" (parameter ``name``) or "const" (a plain tensor / foreign DistTensor:
    its layout is ``spec`` and cannot be chosen)."""
    kind: str
    node: int = -1
    slot: int = 0
    name: str = ""
    spec: DistSpec | None = None

    @property
    def key(self):
        if self.kind == "op":
            return ("op", self.node, self.slot)
        if self.kind == "input":
            return ("input", self.node)
        if self.kind == "param":
            return ("param", self.name)
        return None


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
    shape = getattr(spec, "shape", None)
    dtype = getattr(spec, "dtype", None)
    if shape is None and isinstance(spec, (tuple, list)) and len(spec) == 2:
        shape, dtype = spec
    if shape is None or any(s is None or int(s) < 0 for s in shape):
        raise ValueError(f"input {i}: expected a DistSpec, an InputSpec or (shape, dtype) with a fully known "
                         f"shape, got {spec!r}")
    return DistSpec(mesh, tuple(Replicate() for _ in range(mesh.ndim)), tuple(int(s) for s in shape),
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
        where = tracer.layers[-1] if tracer.layers else type(model).__name__
        raise MissingRuleError(f"inside the captured graph of {type(model).__name__} (layer {where!r}, after "
                               f"op #{tracer.count}): {e}") from e
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


def source_needs_grad(g, s: Source) -> bool:
    if s.kind == "op":
        return g.nodes[s.node]["needs_grad"][s.slot]
    if s.kind == "param":
        return g.graph["trainable"].get(s.name, False)
    return False


# =====================================================================================================
# 2. propagation to a fixpoint
# =====================================================================================================
def _fixed_layout(g, s: Source):
    """The annotated (hard) layout of a source, or None when it is free / not a source."""
    if s.kind == "param":
        return g.graph["fixed_params"].get(s.name)
    if s.kind == "input":
        return g.graph["inputs"][s.node].placements if g.graph["fixed_inputs"][s.node] else None
    if s.kind == "const":
        return s.spec.placements
    return None


def _storable(placements):
    """A stored layout (parameters, inputs) never holds a pending reduction: Partial becomes Replicate."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def _call_with(d, specs):
    args, kwargs = d["call"]
    return replace_specs(args, kwargs, specs)


def propagate(g) -> dict:
    """Layouts inferred from the annotations: {tensor key: placements} (see Source.key), forward and
    reverse rules alternating until nothing new is inferred (a tensor keeps its first inference)."""
    known = {}
    for name, pl in g.graph["fixed_params"].items():
        known[("param", name)] = tuple(pl)
    for i, spec in enumerate(g.graph["inputs"]):
        if g.graph["fixed_inputs"][i]:
            known[("input", i)] = spec.placements
    for (node, slot), (pl, _) in g.graph["out_annotations"].items():
        known[("op", node, slot)] = pl
    order = sorted(g.nodes)
    changed = True
    while changed:
        changed = False
        for k in order:
            changed |= _forward_step(g, k, known)
        for k in reversed(order):
            changed |= _reverse_step(g, k, known)
    return known


def _leaf_specs(g, k, known):
    d = g.nodes[k]
    specs, any_known = [], False
    for i, s in enumerate(d["sources"]):
        seen = d["seen"][i]
        pl = _fixed_layout(g, s) if s.kind == "const" else known.get(s.key)
        if pl is not None and s.kind != "const":
            any_known = True
        specs.append(seen.with_placements(pl) if pl is not None else
                     seen.with_placements([Replicate()] * seen.mesh.ndim))
    return specs, any_known


def _learn(known, key, placements, store: bool) -> bool:
    """Record an inferred layout for an unknown tensor. Replicate everywhere carries no information (it is
    what an unknown tensor reads as), so it is not recorded: a later inference may still fill it in."""
    if key is None or key in known or all(p.is_replicate() for p in placements):
        return False
    known[key] = _storable(placements) if store else tuple(placements)
    return True


def _forward_step(g, k, known) -> bool:
    d = g.nodes[k]
    specs, any_known = _leaf_specs(g, k, known)
    if not any_known or d["greedy"] is None:
        return False
    args, kwargs = _call_with(d, specs)
    try:
        res = get_spmd_rule(d["op"])(*args, **kwargs)
    except (ValueError, TypeError, NotImplementedError, IndexError):
        return False
    changed = False
    for i, s in enumerate(d["sources"]):
        if s.kind in ("param", "input"):
            changed |= _learn(known, s.key, res.inputs[i].placements, store=True)
    for slot, o in enumerate(res.outputs):
        if o is not None:
            changed |= _learn(known, ("op", k, slot), o.placements, store=False)
    return changed


def _reverse_step(g, k, known) -> bool:
    d = g.nodes[k]
    rule = get_spmd_rule(d["op"])
    outs = d["outputs"]
    if not rule.has_reverse or d["greedy"] is None or \
            not any(("op", k, j) in known for j, o in enumerate(outs) if o is not None):
        return False
    wanted = tuple(None if o is None else o.with_placements(known.get(("op", k, j), [Replicate()] * o.mesh.ndim))
                   for j, o in enumerate(outs))
    specs, _ = _leaf_specs(g, k, known)
    args, kwargs = _call_with(d, specs)
    try:
        rev = rule.reverse(wanted, *args, **kwargs)
    except (ValueError, TypeError, NotImplementedError, IndexError):
        return False
    changed = False
    for i, s in enumerate(d["sources"]):
        changed |= _learn(known, s.key, rev.inputs[i].placements, store=s.kind != "op")
    return changed


# =====================================================================================================
# 3. candidates (and 4. hard annotations)
# =====================================================================================================
_MAX_DRIVERS = 4      # ops with more tensor inputs: only the largest few drive a mesh dim


def _drivers(specs):
    big = sorted(range(len(specs)), key=lambda i: -specs[i].numel)[:_MAX_DRIVERS]
    out = [None]
    for i in big:
        out += [(i, Shard(d)) for d in range(specs[i].ndim)]
        if specs[i].dtype.startswith(("float", "bfloat")):
            out.append((i, Partial("sum")))
    out.append("all_partial")
    return out


def _result_key(res):
    return (res.inputs, res.outputs, res.local_op)


def candidates(g, k, known=None) -> list:
    """Distinct SpmdResults of op ``k`` (before hard annotations are applied)."""
    d = g.nodes[k]
    if d["greedy"] is None:
        return []
    rule = get_spmd_rule(d["op"])
    seen = list(d["seen"])
    mesh = g.graph["mesh"]
    found = {}

    def add(res):
        found.setdefault(_result_key(res), res)

    def call(specs):
        args, kwargs = _call_with(d, specs)
        try:
            add(rule(*args, **kwargs))
        except (ValueError, TypeError, NotImplementedError, IndexError):
            pass

    add(d["greedy"])
    if known is not None:
        specs, _ = _leaf_specs(g, k, known)
        call(specs)
    fixed = [_fixed_layout(g, s) for s in d["sources"]]
    if any(f is not None for f in fixed):
        call([sp.with_placements(f if f is not None else [Replicate()] * mesh.ndim) for sp, f in zip(seen, fixed)])
    if not seen:
        return list(found.values())
    made = {}

    def spec(i, pl):
        key = (i, pl)
        if key not in made:
            made[key] = seen[i].with_placements(pl)
        return made[key]

    drivers = _drivers(seen)
    per_dim = [drivers if mesh.shape[m] > 1 else [None] for m in range(mesh.ndim)]   # size-1 dims: nothing to split
    for combo in itertools.product(*per_dim):
        pls = [[Replicate()] * mesh.ndim for _ in seen]
        for m, drv in enumerate(combo):
            if drv == "all_partial":
                for i, sp in enumerate(seen):
                    if sp.dtype.startswith(("float", "bfloat")):
                        pls[i][m] = Partial("sum")
            elif drv is not None:
                pls[drv[0]][m] = drv[1]
        try:
            specs = [spec(i, tuple(p)) for i, p in enumerate(pls)]
        except ValueError:
            continue
        call(specs)
    return list(found.values())


def _compatible(required, annotated) -> bool:
    """Is an input required as ``required`` consuming an annotated layout as-is (R may enter as P)?"""
    return all(r == a or (a.is_replicate() and r.is_partial()) for r, a in zip(required, annotated))


def _hard_constraints(g, k):
    """[(description, predicate on an SpmdResult)] for op k's annotated inputs and outputs."""
    d = g.nodes[k]
    out = []
    for i, s in enumerate(d["sources"]):
        hard = s.kind == "param" or (s.kind == "input" and g.graph["hard_inputs"][s.node])
        f = _fixed_layout(g, s) if hard else None
        if f is None:
            continue
        what = f"parameter {s.name!r}" if s.kind == "param" else f"input {s.node}"
        out.append((f"{what} annotated {format_placements(f)}",
                    lambda res, i=i, f=f: _compatible(res.inputs[i].placements, f)))
    for slot, o in enumerate(d["outputs"]):
        ann = g.graph["out_annotations"].get((k, slot))
        if ann is not None:
            pl, layer = ann
            out.append((f"the output of layer {layer!r} annotated {format_placements(pl)}",
                        lambda res, slot=slot, pl=pl: tuple(res.outputs[slot].placements) == tuple(pl)))
    return out


def feasible(g, k, cands) -> list:
    """The candidates honouring every annotation at op k; AnnotationConflictError naming them if none."""
    hard = _hard_constraints(g, k)
    ok = [c for c in cands if all(p(c) for _, p in hard)]
    if ok:
        return ok
    d = g.nodes[k]
    where = f"op {k} ({d['op']} in layer {d['layer']!r})"
    for (a, pa), (b, pb) in itertools.combinations(hard, 2):
        if not any(pa(c) and pb(c) for c in cands):
            raise AnnotationConflictError(
                f"conflicting annotations at {where}: {a} and {b}; no layout of {d['op']} accepts both "
                f"(change one of them, or leave one unannotated and let completion insert the reshard)")
    for a, pa in hard:
        if not any(pa(c) for c in cands):
            raise AnnotationConflictError(f"annotation not satisfiable at {where}: {a}; no layout of "
                                          f"{d['op']} consumes or produces it as annotated")
    raise AnnotationConflictError(f"conflicting annotations at {where}: {'; '.join(a for a, _ in hard)}; no "
                                  f"layout of {d['op']} satisfies all of them together")


# =====================================================================================================
# 5. cost
# =====================================================================================================
class CostModel:
    """Seconds per training step under a cluster spec: compute, reshards and their adjoints, gradient
    reductions. The reshard planner prices every collective (gloo emulations included)."""

    def __init__(self, mesh, cluster=None):
        from autoparallel.comm.world import planning_cluster

        self.mesh = mesh
        self.cluster = cluster if cluster is not None else planning_cluster()
        self.peak = self.cluster.device.flops("float32")
        self.links = [self.cluster.link_for(mesh.all_groups(m)[0]) for m in range(mesh.ndim)]
        self._memo = {}

    def plan(self, spec: DistSpec, dst):
        from reshard import plan_reshard

        key = ("plan", spec, tuple(dst))
        if key not in self._memo:
            self._memo[key] = plan_reshard(spec.shape, spec.dtype, spec.mesh, spec.placements, tuple(dst),
                                           cluster=self.cluster)
        return self._memo[key]

    def reshard(self, spec: DistSpec, dst, grad: bool) -> float:
        """Forward reshard seconds, plus the backward adjoint when the tensor needs a gradient (priced as the
        cheapest reshard of the gradient back: its Partial dims read as Replicate)."""
        dst = tuple(dst)
        if dst == spec.placements:
            return 0.0
        key = ("reshard", spec, dst, grad)
        c = self._memo.get(key)
        if c is None:
            c = self.seconds(spec, dst)
            back_src, back_dst = _storable(dst), _storable(spec.placements)
            if grad and back_src != back_dst:
                c += self.seconds(spec.with_placements(back_src), back_dst)
            self._memo[key] = c
        return c

    def seconds(self, spec: DistSpec, dst) -> float:
        """Cost of the cheapest reshard (the reshard planner's optimum), from one Dijkstra per source layout
        over the planner's own state graph and step prices."""
        dst = tuple(dst)
        if any(p.is_partial() and p.reduce_type != "sum" for p in dst):
            return self.plan(spec, dst).seconds
        key = ("dist", spec)
        table = self._memo.get(key)
        if table is None:
            table = self._memo[key] = self._distances(spec)
        if dst not in table:
            return self.plan(spec, dst).seconds
        return table[dst]

    def _distances(self, spec: DistSpec) -> dict:
        import heapq

        from reshard.planner import pricer
        from reshard.transitions import moves

        price = pricer(spec.shape, spec.dtype, spec.mesh, self.cluster)
        targets = tuple(Partial("sum") for _ in range(self.mesh.ndim))
        memo = self._memo.setdefault(("price", spec.shape, spec.dtype), {})
        dist = {spec.placements: 0.0}
        heap = [(0.0, 0, spec.placements)]
        tick = 1
        while heap:
            d, _, u = heapq.heappop(heap)
            if d > dist[u]:
                continue
            for collective, i, v in moves(u, self.mesh.shape, spec.ndim, targets):
                k = (collective, i, price.local_nbytes(u), u[i])
                c = memo.get(k)
                if c is None:
                    c = memo[k] = price.price(collective, i, u).seconds
                nd = d + c
                if nd < dist.get(v, float("inf")):
                    dist[v] = nd
                    heapq.heappush(heap, (nd, tick, v))
                    tick += 1
        return dist

    def compute(self, flops: float, res) -> float:
        """Forward + backward (3x) FLOPs of the op, split over the mesh dims where it shards something."""
        frac = 1.0
        for m in range(self.mesh.ndim):
            if any(s is not None and s.placements[m].is_shard() for s in res.inputs + res.outputs):
                frac /= self.mesh.shape[m]
        return 3.0 * flops * frac / self.peak

    def grad_all_reduce(self, spec: DistSpec, dims, latency: bool = True) -> float:
        """All-reduce of a gradient laid out like ``spec`` over mesh ``dims`` (bucketed: no latency)."""
        from autoparallel.comm.cost import collective_bytes, collective_steps

        total = 0.0
        b = spec.local_nbytes()
        for m in dims:
            n = self.mesh.shape[m]
            link = self.links[m]
            total += collective_bytes("all_reduce", b, n) / link.bandwidth_Bps
            if latency:
                total += collective_steps("all_reduce", n) * link.latency_s
        return total


def split_dims(res, mesh) -> list:
    return [m for m in res.split_mesh_dims() if mesh.shape[m] > 1]


def use_cost(cm, spec: DistSpec, req: DistSpec, res, grad: bool, direct_param: bool) -> float:
    """Seconds to feed a tensor laid out as ``spec`` into an op (result ``res``) requiring ``req``: the
    reshard (and adjoint) plus the gradient reduction over split dims where ``req`` is replicated — bucketed
    when a parameter is used as stored, an all_reduce in backward otherwise (dispatch's rule)."""
    c = cm.reshard(spec, req.placements, grad)
    if grad:
        dims = [m for m in split_dims(res, cm.mesh) if req.placements[m].is_replicate()]
        if dims:
            stored = direct_param and spec.placements == req.placements
            c += cm.grad_all_reduce(req, dims, latency=not stored)
    return c


# =====================================================================================================
# 6. the discrete problem and its exact solution
# =====================================================================================================
class Problem:
    """min over one state per variable of sum(unary[v][x_v]) + sum(pair[(u, w)][x_u, x_w])."""

    def __init__(self, sizes):
        self.sizes = list(sizes)
        self.unary = [np.zeros(n) for n in self.sizes]
        self.pairs = {}

    def add_pair(self, u, w, table):
        table = np.asarray(table, dtype=float)
        if u == w:
            self.unary[u] += np.diag(table)
            return
        if u > w:
            u, w, table = w, u, table.T
        if (u, w) in self.pairs:
            self.pairs[(u, w)] = self.pairs[(u, w)] + table
        else:
            self.pairs[(u, w)] = table.copy()

    def cost(self, assign) -> float:
        total = sum(float(self.unary[v][assign[v]]) for v in range(len(self.sizes)))
        return total + sum(float(t[assign[u], assign[w]]) for (u, w), t in self.pairs.items())

    def size(self) -> int:
        return int(np.prod([float(n) for n in self.sizes]))


def exhaustive(problem: Problem, limit: int = 2_000_000):
    """Every combination (for checking the solver on small problems)."""
    if problem.size() > limit:
        raise ValueError(f"exhaustive search over {problem.size()} combinations exceeds the limit {limit}")
    best, arg = float("inf"), None
    for assign in itertools.product(*[range(n) for n in problem.sizes]):
        c = problem.cost(assign)
        if c < best - 1e-15:
            best, arg = c, assign
    return list(arg), best


def _eliminate(problem: Problem):
    """Dynamic programming: remove variables with <= 2 neighbours, folding them into the rest.
    Returns (remaining variables, unary, pairs, records for back-substitution)."""
    unary = [u.copy() for u in problem.unary]
    pairs = {k: t.copy() for k, t in problem.pairs.items()}
    nbrs = {v: set() for v in range(len(unary))}
    for u, w in pairs:
        nbrs[u].add(w)
        nbrs[w].add(u)

    def get(u, w):
        return pairs[(u, w)] if u < w else pairs[(w, u)].T

    def put(u, w, t):
        if u > w:
            u, w, t = w, u, t.T
        pairs[(u, w)] = pairs[(u, w)] + t if (u, w) in pairs else t
        nbrs[u].add(w)
        nbrs[w].add(u)

    def drop(u, w):
        pairs.pop((min(u, w), max(u, w)))
        nbrs[u].discard(w)
        nbrs[w].discard(u)

    alive = set(range(len(unary)))
    records = []
    queue = [v for v in alive if len(nbrs[v]) <= 2]
    while queue:
        v = queue.pop()
        if v not in alive or len(nbrs[v]) > 2:
            continue
        ns = sorted(nbrs[v])
        if not ns:
            records.append((v, (), int(np.argmin(unary[v]))))
        elif len(ns) == 1:
            u = ns[0]
            t = get(u, v) + unary[v][None, :]
            unary[u] = unary[u] + t.min(axis=1)
            records.append((v, (u,), t.argmin(axis=1)))
            drop(u, v)
        else:
            u, w = ns
            a, b = get(u, v), get(v, w)
            best = np.empty((a.shape[0], b.shape[1]))
            arg = np.empty((a.shape[0], b.shape[1]), dtype=np.int64)
            for i in range(a.shape[0]):
                t = (a[i] + unary[v])[:, None] + b
                arg[i] = t.argmin(axis=0)
                best[i] = t[arg[i], np.arange(t.shape[1])]
            records.append((v, (u, w), arg))
            drop(u, v)
            drop(v, w)
            put(u, w, best)
        alive.discard(v)
        queue.extend(n for n in ns if n in alive and len(nbrs[n]) <= 2)
    return alive, unary, pairs, records


def _back_substitute(assign, records):
    for v, ns, arg in reversed(records):
        if not ns:
            assign[v] = int(arg)
        elif len(ns) == 1:
            assign[v] = int(arg[assign[ns[0]]])
        else:
            assign[v] = int(arg[assign[ns[0]], assign[ns[1]]])
    return assign


def _prune(vs, unary, pairs):
    """Dead-end elimination (Goldstein): drop states that another state of the same variable beats whatever
    the neighbours do. Keeps an optimum. Returns {v: kept state indices}."""
    keep = {v: np.arange(len(unary[v])) for v in vs}
    nb = {v: [] for v in vs}
    for (u, w), t in pairs.items():
        nb[u].append((w, t))
        nb[w].append((u, t.T))
    for v in vs:
        ks = keep[v]
        if len(ks) <= 1:
            continue
        rows = [t for _, t in nb[v]]
        # a is dominated by b if  unary[a] - unary[b] + sum_n min_c (t[a, c] - t[b, c]) > 0
        dead = np.zeros(len(unary[v]), dtype=bool)
        order = np.argsort(unary[v])
        for b in order[:8]:
            gain = unary[v] - unary[v][b]
            for t in rows:
                gain = gain + (t - t[b][None, :]).min(axis=1)
            hit = gain > 1e-12
            hit[b] = False
            dead |= hit & ~dead
        kept = np.flatnonzero(~dead)
        keep[v] = kept if len(kept) else np.array([int(np.argmin(unary[v]))])
    return keep


def _ilp(vs, unary, pairs, time_limit=120.0):
    """Exact solution of the remaining core by HiGHS (local polytope + integral states)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    vs = sorted(vs)
    keep = _prune(vs, unary, {k: t for k, t in pairs.items() if k[0] in vs and k[1] in vs})
    xoff, n = {}, 0
    for v in vs:
        xoff[v] = n
        n += len(keep[v])
    yoff = {}
    for (u, w) in pairs:
        yoff[(u, w)] = n
        n += len(keep[u]) * len(keep[w])
    scale = 1e6                                 # seconds -> microseconds: well inside HiGHS's tolerances
    c = np.zeros(n)
    integ = np.zeros(n)
    rows, cols, vals, rhs = [], [], [], []
    r = 0
    for v in vs:
        kv = keep[v]
        c[xoff[v]:xoff[v] + len(kv)] = unary[v][kv] * scale
        integ[xoff[v]:xoff[v] + len(kv)] = 1
        rows += [r] * len(kv)
        cols += list(range(xoff[v], xoff[v] + len(kv)))
        vals += [1.0] * len(kv)
        rhs.append(1.0)
        r += 1
    for (u, w), t in pairs.items():
        ku, kw = keep[u], keep[w]
        sub = t[np.ix_(ku, kw)]
        base = yoff[(u, w)]
        c[base:base + sub.size] = sub.ravel() * scale
        nu, nw = len(ku), len(kw)
        for a in range(nu):                     # sum_c y[a, c] = x_u[a]
            rows += [r] * (nw + 1)
            cols += list(range(base + a * nw, base + a * nw + nw)) + [xoff[u] + a]
            vals += [1.0] * nw + [-1.0]
            rhs.append(0.0)
            r += 1
        for b in range(nw):                     # sum_a y[a, c] = x_w[c]
            rows += [r] * (nu + 1)
            cols += [base + a * nw + b for a in range(nu)] + [xoff[w] + b]
            vals += [1.0] * nu + [-1.0]
            rhs.append(0.0)
            r += 1
    A = coo_matrix((vals, (rows, cols)), shape=(r, n)).tocsr()
    res = milp(c, constraints=LinearConstraint(A, rhs, rhs), integrality=integ, bounds=Bounds(0, 1),
               options={"time_limit": time_limit, "mip_rel_gap": 0.0})
    if res.x is None:
        raise RuntimeError(f"the layout integer program found no solution ({res.message})")
    assign = {}
    for v in vs:
        kv = keep[v]
        assign[v] = int(kv[int(np.argmax(res.x[xoff[v]:xoff[v] + len(kv)]))])
    return assign, {"ilp_vars": n, "ilp_rows": r, "ilp_status": res.message, "ilp_optimal": res.status == 0}


def solve(problem: Problem, method: str = "auto"):
    """(assignment, cost, stats). ``method``: "auto" (DP elimination, then ILP on what branches), "ilp"
    (the whole problem as one integer program) or "exhaustive"."""
    if method == "exhaustive":
        assign, cost = exhaustive(problem)
        return assign, cost, {"method": "exhaustive"}
    if method not in ("auto", "ilp"):
        raise ValueError(f"method must be 'auto', 'ilp' or 'exhaustive', got {method!r}")
    stats = {"method": method, "variables": len(problem.sizes), "pairs": len(problem.pairs)}
    if method == "ilp":
        core = set(range(len(problem.sizes)))
        unary, pairs, records = problem.unary, problem.pairs, []
    else:
        core, unary, pairs, records = _eliminate(problem)
    stats["eliminated"] = len(records)
    stats["core"] = len(core)
    assign = [0] * len(problem.sizes)
    if core:
        sub, info = _ilp(core, unary, {k: t for k, t in pairs.items() if k[0] in core and k[1] in core})
        stats.update(info)
        for v, s in sub.items():
            assign[v] = s
    _back_substitute(assign, records)
    return assign, problem.cost(assign), stats


# =====================================================================================================
# building the problem from a captured graph
# =====================================================================================================
@dataclass
class _Var:
    kind: str                   # "op" or "source"
    key: object                 # node id, or a source key
    states: list                # SpmdResults, or stored placements


def _free_sources(g):
    """Sources whose layout completion chooses, with their uses: {key: [(node, slot)]}."""
    out = {}
    for key, uses in g.graph["param_uses"].items():
        kind = key[0]
        if kind == "param" and key[1] in g.graph["fixed_params"]:
            continue
        if kind == "input" and g.graph["fixed_inputs"][key[1]]:
            continue
        out[key] = uses
    return out


def _source_spec(g, key, placements):
    if key[0] == "param":
        return g.graph["param_specs"][key[1]].with_placements(placements)
    return g.graph["inputs"][key[1]].with_placements(placements)


def build_problem(g, cands: dict, cm: CostModel, fixed_sources: dict | None = None):
    """(Problem, variables) for graph ``g`` with candidate SpmdResults ``cands[node]``.

    Free sources used once are stored as their consumer requires (folded into that op); free sources used
    more than once become variables. ``fixed_sources`` {source key: placements} overrides that (used to
    price an eager run, whose parameters stay where they are)."""
    fixed_sources = dict(fixed_sources or {})
    mesh = g.graph["mesh"]
    nodes = sorted(g.nodes)
    free = {k: u for k, u in _free_sources(g).items() if k not in fixed_sources}
    multi = {k: u for k, u in free.items() if len(u) > 1}
    variables = [_Var("op", k, cands[k]) for k in nodes]
    index = {k: i for i, k in enumerate(nodes)}
    for key, uses in multi.items():
        states = {tuple(Replicate() for _ in range(mesh.ndim))}
        for node, slot in uses:
            states |= {_storable(r.inputs[slot].placements) for r in cands[node]}
        index[key] = len(variables)
        variables.append(_Var("source", key, sorted(states, key=format_placements)))
    problem = Problem([len(v.states) for v in variables])
    loss = g.graph.get("loss")
    for k in nodes:
        d = g.nodes[k]
        vi = index[k]
        un = problem.unary[vi]
        for si, res in enumerate(cands[k]):
            un[si] += cm.compute(d["flops"], res)
            if loss is not None and loss[0] == k:
                un[si] += cm.seconds(res.outputs[loss[1]], [Replicate()] * mesh.ndim)
        for i, s in enumerate(d["sources"]):
            grad = source_needs_grad(g, s)
            if s.kind == "op":
                _add_edge(problem, index[s.node], vi, cands[s.node], cands[k], s.slot, i, cm, grad)
                for si, res in enumerate(cands[k]):
                    un[si] += use_cost(cm, res.inputs[i], res.inputs[i], res, grad, False)
            elif s.key in multi:
                var = variables[index[s.key]]
                table = np.zeros((len(var.states), len(cands[k])))
                for a, pl in enumerate(var.states):
                    spec = _source_spec(g, s.key, pl)
                    for si, res in enumerate(cands[k]):
                        table[a, si] = use_cost(cm, spec, res.inputs[i], res, grad, s.kind == "param")
                problem.add_pair(index[s.key], vi, table)
            else:
                for si, res in enumerate(cands[k]):
                    req = res.inputs[i]
                    if s.key in free:
                        spec = req.with_placements(_storable(req.placements))
                    elif s.key in fixed_sources:
                        spec = req.with_placements(fixed_sources[s.key])
                    elif s.kind == "const":
                        spec = s.spec
                    else:
                        spec = req.with_placements(_fixed_layout(g, s))
                    un[si] += use_cost(cm, spec, req, res, grad, s.kind == "param")
    return problem, variables


def _add_edge(problem, u, w, cu, cw, slot, i, cm, grad):
    """Pairwise reshard cost: producer state a's output ``slot`` -> consumer state b's input ``i``."""
    outs = [r.outputs[slot] for r in cu]
    reqs = [r.inputs[i].placements for r in cw]
    ou = {}
    oi = np.array([ou.setdefault(o, len(ou)) for o in outs])
    ru = {}
    ri = np.array([ru.setdefault(q, len(ru)) for q in reqs])
    small = np.zeros((len(ou), len(ru)))
    for o, a in ou.items():
        for q, b in ru.items():
            small[a, b] = cm.reshard(o, q, grad)
    problem.add_pair(u, w, small[np.ix_(oi, ri)])


# =====================================================================================================
# the completed plan
# =====================================================================================================
@dataclass
class CompletedPlan:
    """Chosen layouts of a captured graph: per op its SpmdResult, per source its stored layout."""
    graph: nx.DiGraph
    results: dict                               # node -> SpmdResult
    source_layouts: dict                        # source key -> placements (every param and input)
    cost: float
    greedy_cost: float
    stats: dict = field(default_factory=dict)
    cost_model: CostModel | None = None

    @property
    def mesh(self):
        return self.graph.graph["mesh"]

    @property
    def ops(self) -> list:
        return [self.graph.nodes[k]["op"] for k in sorted(self.graph.nodes)]

    def ordered_results(self, model_only: bool = False) -> list:
        n = self.graph.graph["n_model_ops"] if model_only else self.graph.number_of_nodes()
        return [self.results[k] for k in sorted(self.graph.nodes)[:n]]

    def pinned(self, model_only: bool = False):
        """``with plan.pinned():`` run the forward (and loss) with these layouts through dispatch."""
        from autoparallel import dispatch

        n = self.graph.graph["n_model_ops"] if model_only else self.graph.number_of_nodes()
        return dispatch.pinned(self.ops[:n], self.ordered_results(model_only))

    @property
    def param_layouts(self) -> dict:
        return {k[1]: v for k, v in self.source_layouts.items() if k[0] == "param"}

    @property
    def input_layouts(self) -> list:
        return [self.source_layouts[("input", i)] for i in range(len(self.graph.graph["inputs"]))]

    def input_of(self, node: int, slot: int):
        """(source description, layout it has before the op) for an op's input."""
        s = self.graph.nodes[node]["sources"][slot]
        if s.kind == "op":
            return f"%{s.node}" + (f".{s.slot}" if len(self.graph.nodes[s.node]["outputs"]) > 1 else ""), \
                self.results[s.node].outputs[s.slot]
        if s.kind == "const":
            return "const", s.spec
        return (s.name if s.kind == "param" else f"input{s.node}"), \
            self.results[node].inputs[slot].with_placements(self.source_layouts[s.key])

    def reshards(self, node: int) -> list:
        """[(slot, source description, ReshardPlan)] the op inserts before running (forward)."""
        out = []
        res = self.results[node]
        for i in range(len(res.inputs)):
            desc, spec = self.input_of(node, i)
            if spec.placements != res.inputs[i].placements:
                out.append((i, desc, self.cost_model.plan(spec, res.inputs[i].placements)))
        return out

    def backward_collectives(self, node: int) -> list:
        """[(text, collective)] the op causes in backward: adjoints of its reshards and gradient
        all-reduces of replicated inputs of a split op (a parameter used as stored: a bucketed reduction)."""
        g, res = self.graph, self.results[node]
        out = []
        for i, s in enumerate(g.nodes[node]["sources"]):
            if not source_needs_grad(g, s):
                continue
            desc, spec = self.input_of(node, i)
            req = res.inputs[i]
            if spec.placements != req.placements:
                for st in self.cost_model.plan(spec, req.placements).steps:
                    back = {"slice": "all_gather", "reduce_scatter": "all_gather", "all_to_all": "all_to_all"}
                    if st.collective in back:
                        out.append((f"{back[st.collective]} grad of {desc} (mesh dim {st.mesh_dim})",
                                    back[st.collective]))
            dims = [m for m in split_dims(res, self.mesh) if req.placements[m].is_replicate()]
            if dims:
                stored = s.kind == "param" and spec.placements == req.placements
                kind = "bucketed grad reduction" if stored else "all_reduce grad"
                out.append((f"{kind} of {desc} over mesh dim{'s' if len(dims) > 1 else ''} "
                            f"{','.join(map(str, dims))}", "all_reduce"))
        return out

    def recomputed(self) -> dict:
        """{op id: recompute region} of the ops whose forward runs again in backward."""
        return {k: self.graph.nodes[k]["recompute"] for k in sorted(self.graph.nodes)
                if self.graph.nodes[k].get("recompute") is not None}

    def collective_counts(self) -> dict:
        """{"forward": {collective: count}, "backward": {collective: count}} as planned (the forward
        collectives of recomputed ops run again in backward)."""
        fwd, bwd = {}, {}
        again = self.recomputed()
        for k in sorted(self.graph.nodes):
            for _, _, p in self.reshards(k):
                for st in p.steps:
                    if st.collective not in ("slice", "local"):
                        fwd[st.collective] = fwd.get(st.collective, 0) + 1
                        if k in again:
                            bwd[st.collective] = bwd.get(st.collective, 0) + 1
            for _, c in self.backward_collectives(k):
                bwd[c] = bwd.get(c, 0) + 1
        return {"forward": fwd, "backward": bwd}

    def listing(self) -> str:
        """One line per op: layer, rule, input layouts -> output layouts, and the collectives it causes."""
        g = self.graph
        lines = [f"completed plan on mesh {self.mesh.short()} {self.mesh.dim_names}: {g.number_of_nodes()} ops, "
                 f"estimated {self.cost * 1e3:.3f} ms/step (eager dispatch: {self.greedy_cost * 1e3:.3f} ms), "
                 f"solver {self.stats.get('method')}: {self.stats.get('eliminated', 0)} eliminated by DP, "
                 f"{self.stats.get('core', 0)} in the ILP"]
        again = self.recomputed()
        if again:
            lines.append(f"recompute: {len(again)} ops in {len(set(again.values()))} regions run again in backward "
                         f"with the same layouts (marked 'recompute rN')")
        for k in sorted(g.nodes):
            d, res = g.nodes[k], self.results[k]
            ins = []
            for i, r in enumerate(res.inputs):
                desc, _ = self.input_of(k, i)
                ins.append(f"{desc}:{_fmt(r.placements)}")
            outs = ", ".join("-" if o is None else _fmt(o.placements) for o in res.outputs)
            via = f" via {res.local_op}" if res.local_op else ""
            rc = f"  recompute r{again[k]}" if k in again else ""
            lines.append(f"%{k:<3} {d['layer'][:24]:<24} {d['op']:<12} ({', '.join(ins)}) -> {outs}{via}{rc}")
            for i, desc, p in self.reshards(k):
                for st in p.steps:
                    if st.collective in ("slice", "local"):
                        continue
                    lines.append(f"       fwd {st.collective} {desc} {format_placements(st.src)} -> "
                                 f"{format_placements(st.dst)} ({st.bytes_per_rank / 1e3:.1f} kB/rank)")
            for text, _ in self.backward_collectives(k):
                lines.append(f"       bwd {text}")
        lines.append("parameters:")
        fixed = g.graph["fixed_params"]
        for name, pl in sorted(self.param_layouts.items()):
            lines.append(f"  {name:<32} {_fmt(pl)}{'  (annotated)' if name in fixed else ''}")
        for i, pl in enumerate(self.input_layouts):
            tag = "  (annotated)" if g.graph["hard_inputs"][i] else \
                "  (arrives so)" if g.graph["fixed_inputs"][i] else ""
            lines.append(f"  input{i:<27} {_fmt(pl)}{tag}")
        counts = self.collective_counts()
        lines.append(f"collectives per step: forward {counts['forward'] or '{}'}, "
                     f"backward {counts['backward'] or '{}'}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.listing()

    def placements(self, node: int, slot: int = 0, output: bool = True) -> str:
        """``"[S(0), R]"``: an op's output (or required input) layout as a string."""
        res = self.results[node]
        return _fmt((res.outputs if output else res.inputs)[slot].placements)

    def nodes_in(self, layer: str, op: str | None = None) -> list:
        """Op ids run by a sublayer (glob pattern), optionally of one rule."""
        return [k for k in sorted(self.graph.nodes) if fnmatch.fnmatchcase(self.graph.nodes[k]["layer"], layer)
                and (op is None or self.graph.nodes[k]["op"] == op)]


def _fmt(placements) -> str:
    return "[" + ", ".join(str(p) for p in placements) + "]"


def _greedy(g, cm):
    """Modelled cost of plain eager dispatch: every op's rule on what arrives, sources where they are."""
    cands = {k: [g.nodes[k]["greedy"]] for k in g.nodes}
    fixed = {}
    for key in g.graph["param_uses"]:
        if key[0] == "param":
            fixed[key] = g.graph["param_specs"][key[1]].placements
        else:
            fixed[key] = g.graph["inputs"][key[1]].placements
    problem, _ = build_problem(g, cands, cm, fixed_sources=fixed)
    return problem.cost([0] * len(problem.sizes))


def complete_graph(g, cluster=None, method: str = "auto") -> CompletedPlan:
    """Complete a graph from ``capture``: propagate, enumerate, price and solve (module docstring)."""
    missing = [k for k in g.nodes if g.nodes[k].get("greedy") is None]
    if missing:
        raise ValueError(f"graph nodes {missing[:5]} carry no rule call: capture the graph with "
                         f"completion.capture (ap.trace graphs lack the call attributes)")
    cm = CostModel(g.graph["mesh"], cluster)
    known = propagate(g)
    cands = {k: feasible(g, k, candidates(g, k, known)) for k in sorted(g.nodes)}
    problem, variables = build_problem(g, cands, cm)
    assign, cost, stats = solve(problem, method)
    results = {}
    layouts = {}
    for v, s in zip(variables, assign):
        if v.kind == "op":
            results[v.key] = v.states[s]
        else:
            layouts[v.key] = tuple(v.states[s])
    for key, uses in g.graph["param_uses"].items():
        if key in layouts:
            continue
        fixed = g.graph["fixed_params"].get(key[1]) if key[0] == "param" else \
            (g.graph["inputs"][key[1]].placements if g.graph["fixed_inputs"][key[1]] else None)
        if fixed is not None:
            layouts[key] = tuple(fixed)
        else:
            node, slot = uses[0]
            layouts[key] = _storable(results[node].inputs[slot].placements)
    mesh = g.graph["mesh"]
    for name, spec in g.graph["param_specs"].items():          # parameters no op uses
        layouts.setdefault(("param", name), tuple(g.graph["fixed_params"].get(name, spec.placements)))
    for i, spec in enumerate(g.graph["inputs"]):
        layouts.setdefault(("input", i), spec.placements if g.graph["fixed_inputs"][i]
                           else tuple(Replicate() for _ in range(mesh.ndim)))
    stats["candidates"] = int(sum(len(c) for c in cands.values()))
    return CompletedPlan(g, results, layouts, cost, _greedy(g, cm), stats, cm)


def complete(model, *input_specs, loss_fn=None, annotations=None, n_model_inputs=None, mesh=None,
             auto_mode: str = "semi", cluster=None, method: str = "auto", hard_inputs=False) -> CompletedPlan:
    """Capture ``model`` (and ``loss_fn``) on ``input_specs`` and choose every layout by total cost.

    ``auto_mode="semi"``: annotations and already distributed parameters are fixed, DistSpec inputs give the
    layout the data arrives in (consumed as is with ``hard_inputs``); ``"full"``: input layouts are free
    (annotations, if any, are still honoured).
    """
    if auto_mode not in ("semi", "full"):
        raise ValueError(f"auto_mode must be 'semi' or 'full', got {auto_mode!r}")
    if not callable(model):
        raise TypeError(f"complete expects the model as a paddle.nn.Layer (or a callable), got "
                        f"{type(model).__name__} {model!r:.60}")
    g = capture(model, *input_specs, loss_fn=loss_fn, n_model_inputs=n_model_inputs, annotations=annotations,
                mesh=mesh, free_inputs=auto_mode == "full", hard_inputs=hard_inputs)
    return complete_graph(g, cluster=cluster, method=method)
