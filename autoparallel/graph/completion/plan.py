"""The completed plan: chosen layouts per op and source, their listing and collective counts."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import networkx as nx

from autoparallel.graph.completion.cost import CostModel, split_dims
from autoparallel.graph.completion.sources import source_needs_grad
from autoparallel.placement import format_placements


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
                out.append((i, desc, self.cost_model.reshard_plan(spec, res.inputs[i].placements)))
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
                for st in self.cost_model.reshard_plan(spec, req.placements).steps:
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
