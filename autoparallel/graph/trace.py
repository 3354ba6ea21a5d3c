"""Trace a model's forward into a networkx op graph without computing anything.

    graph = ap.trace(model, DistSpec(mesh, [Shard(0), Replicate()], (8, 1024), "int64"),
                     param_placements={"blocks.0.attn.qkv.weight": [Replicate(), Shard(1)]})

Inputs are spec-only DistTensors (no data); every op runs through dispatch, where the rule alone gives
the output specs (rules are shape functions), so a model built under ``paddle.LazyGuard`` is never
allocated. Each node records the op, its required input specs, output specs, the reshards dispatch
would insert (with their collectives and bytes), FLOPs and bytes touched. ``param_placements`` maps
parameter names (or a TP plan dict of layer patterns to styles) to placements; other parameters are
replicated.
"""
from __future__ import annotations

import contextlib
import fnmatch

import networkx as nx
import numpy as np

from autoparallel.context import state as _state
from autoparallel.placement import Replicate, Shard
from autoparallel.spec import DistSpec


class Tracer:
    def __init__(self, param_specs: dict, mesh=None):
        self.mesh = mesh
        self.graph = nx.DiGraph()
        self.param_specs = param_specs          # id(param) -> DistSpec
        self.producer = {}                      # id(DistTensor) -> node id
        self.count = 0

    def record(self, op, inputs, required, outputs, reshards):
        node = self.count
        self.count += 1
        self.graph.add_node(node, op=op, inputs=tuple(required), outputs=tuple(outputs), reshards=tuple(reshards),
                            flops=_flops(op, required, outputs), bytes=_bytes(required, outputs))
        for x in inputs:
            src = self.producer.get(id(x))
            if src is not None:
                self.graph.add_edge(src, node)
        return node


def active():
    return _state.tracer


@contextlib.contextmanager
def tracing(tracer: Tracer):
    prev = active()
    _state.tracer = tracer
    try:
        yield tracer
    finally:
        _state.tracer = prev


def _flops(op, ins, outs):
    out = next((o for o in outs if o is not None), None)
    if out is None:
        return 0
    n = float(np.prod(out.shape)) if out.shape else 1.0
    if op in ("matmul", "linear", "bmm") and ins and ins[0] is not None:
        return 2.0 * n * (ins[0].shape[-1] if ins[0].shape else 1)
    return n


def _bytes(ins, outs):
    return float(sum(s.nbytes for s in list(ins) + list(outs) if s is not None))


def _param_specs(model, mesh, param_placements) -> dict:
    from autoparallel.parallel.tensor_parallel import STYLES, ColWiseParallel, RowWiseParallel, \
        VocabParallelEmbedding

    named = dict(model.named_parameters())
    wanted = {}
    for key, val in (param_placements or {}).items():
        if isinstance(val, STYLES):
            dim = mesh.dim_index("model") if "model" in mesh.dim_names else mesh.ndim - 1
            for name in named:
                layer = name.rsplit(".", 1)[0]
                if not fnmatch.fnmatchcase(layer, key):
                    continue
                leaf = name.rsplit(".", 1)[1]
                p = {ColWiseParallel: {"weight": Shard(1), "bias": Shard(0)},
                     RowWiseParallel: {"weight": Shard(0)},
                     VocabParallelEmbedding: {"weight": Shard(0)}}.get(type(val), {}).get(leaf)
                if p is not None:
                    pl = [Replicate()] * mesh.ndim
                    pl[dim] = p
                    wanted[name] = pl
        else:
            if key not in named:
                raise ValueError(f"param_placements names {key!r}, which is not a parameter of "
                                 f"{type(model).__name__}")
            wanted[key] = list(val)
    out = {}
    for name, p in named.items():
        pl = wanted.get(name, [Replicate()] * mesh.ndim)
        out[id(p)] = DistSpec(mesh, tuple(pl), tuple(p.shape), str(p.dtype))
    return out


def trace(model, *input_specs, param_placements=None) -> nx.DiGraph:
    """The forward op graph of ``model`` on spec-only inputs (see module docstring)."""
    from autoparallel import dispatch_handle
    from autoparallel.dist_tensor import DistTensor

    if not input_specs or not all(isinstance(s, DistSpec) for s in input_specs):
        raise TypeError(f"trace expects one or more DistSpec inputs, got {[type(s).__name__ for s in input_specs]}")
    dispatch_handle.install()
    mesh = input_specs[0].mesh
    tracer = Tracer(_param_specs(model, mesh, param_placements), mesh)
    inputs = [DistTensor({}, s) for s in input_specs]
    with tracing(tracer):
        out = model(*inputs)
    tracer.graph.graph["outputs"] = out
    tracer.graph.graph["mesh"] = mesh
    return tracer.graph


def summary(graph: nx.DiGraph) -> dict:
    """Totals of a traced graph: ops, FLOPs, bytes, and the collectives the reshards would run."""
    coll = {}
    for _, d in graph.nodes(data=True):
        for plan in d["reshards"]:
            for step in plan.steps:
                n, b = coll.get(step.collective, (0, 0.0))
                coll[step.collective] = (n + 1, b + step.bytes_per_rank)
    return {"ops": graph.number_of_nodes(), "flops": sum(d["flops"] for _, d in graph.nodes(data=True)),
            "bytes": sum(d["bytes"] for _, d in graph.nodes(data=True)), "collectives": coll}
