"""Where an op's input comes from, and the layout rules every step shares about sources."""
from __future__ import annotations

from dataclasses import dataclass

from autoparallel.placement import Replicate
from autoparallel.spec import DistSpec


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


def source_needs_grad(g, s: Source) -> bool:
    if s.kind == "op":
        return g.nodes[s.node]["needs_grad"][s.slot]
    if s.kind == "param":
        return g.graph["trainable"].get(s.name, False)
    return False


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
