"""ReshardStep and ReshardPlan: what a reshard does, step by step, and what it costs."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

from autoparallel.core.collective import Collective
from autoparallel.core.mesh import ProcessMesh
from autoparallel.core.placement import format_placements
from autoparallel.core.spec import DistSpec
from reshard.program import compile_plan
from reshard.units import fmt_bytes, fmt_seconds

COLLECTIVES = tuple(Collective)       # the step vocabulary; members equal their names ("slice", "all_gather", ...)


@dataclass(frozen=True)
class ReshardStep:
    """One collective on one mesh dim; ``src``/``dst`` are the full placement states before and after.

    ``collective`` is a ``Collective`` (a name such as ``"all_gather"`` is converted, an unknown one refused).
    ``slice`` and ``local`` communicate nothing: ``slice`` keeps a chunk (R -> S), ``local`` turns R into a
    pending reduction (R -> P). A step on a mesh dim of size 1 costs 0 and leaves the local tensor unchanged.
    ``send_recv`` (``mesh_dim == -1``) moves every rank's local tensor of ``src_mesh`` to the rank at the same
    flat position of ``dst_mesh`` (``k % src_mesh.size`` sends to ``k`` when the sizes differ); steps before it
    run on the source mesh, steps after it on the destination mesh.
    ``emulated`` says how the backend runs a collective it lacks (e.g. ``"all_reduce + slice"``), else None.
    """

    collective: Collective
    mesh_dim: int
    src: tuple
    dst: tuple
    bytes_per_rank: float
    seconds: float
    emulated: Optional[str] = None
    explain: str = ""
    src_mesh: Optional[ProcessMesh] = None
    dst_mesh: Optional[ProcessMesh] = None

    def __post_init__(self):
        object.__setattr__(self, "collective", Collective.of(self.collective))

    @property
    def src_placement(self):
        """Placement of ``mesh_dim`` before the step (None for send_recv)."""
        return None if self.mesh_dim < 0 else self.src[self.mesh_dim]

    @property
    def dst_placement(self):
        """Placement of ``mesh_dim`` after the step (None for send_recv)."""
        return None if self.mesh_dim < 0 else self.dst[self.mesh_dim]

    def columns(self, mesh: ProcessMesh) -> tuple:
        """(what, collective, bytes, time, explanation) for one line of a plan printout."""
        if self.mesh_dim < 0:
            what = (f"mesh {self.src_mesh.short()} {_ranks(self.src_mesh)} -> mesh {self.dst_mesh.short()} "
                    f"{_ranks(self.dst_mesh)}: {format_placements(self.src)}")
            if self.dst != self.src:
                what += f" -> {format_placements(self.dst)}"
        else:
            what = (f"mesh dim {self.mesh_dim} (size {mesh.shape[self.mesh_dim]}): "
                    f"{self.src_placement} -> {self.dst_placement}")
        emu = f" [emulated: {self.emulated}]" if self.emulated else ""
        return what, self.collective + emu, fmt_bytes(self.bytes_per_rank), fmt_seconds(self.seconds), self.explain

    def to_dict(self) -> dict:
        d = {"collective": self.collective, "mesh_dim": self.mesh_dim,
             "src": [str(p) for p in self.src], "dst": [str(p) for p in self.dst],
             "bytes_per_rank": self.bytes_per_rank, "seconds": self.seconds,
             "emulated": self.emulated, "explain": self.explain}
        if self.src_mesh is not None:
            d["src_mesh"] = self.src_mesh.mesh.tolist()
            d["dst_mesh"] = self.dst_mesh.mesh.tolist()
        return d


@dataclass(frozen=True)
class ReshardPlan:
    """The cheapest path from ``src_spec`` to ``dst_spec``; totals are sums over ``steps``."""

    src_spec: DistSpec
    dst_spec: DistSpec
    steps: tuple = ()
    backend: str = "nccl"
    bytes_per_rank: float = field(init=False)
    seconds: float = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "bytes_per_rank", float(sum(s.bytes_per_rank for s in self.steps)))
        object.__setattr__(self, "seconds", float(sum(s.seconds for s in self.steps)))

    @cached_property
    def program(self) -> tuple:
        """Every step's per-group calls (``reshard.program.StepProgram``), compiled on first use and kept."""
        return compile_plan(self)

    @property
    def collectives(self) -> list:
        return [s.collective for s in self.steps]

    def placements_path(self) -> list:
        """States along the path, e.g. ``["(S(0), R)", "(S(0), S(1))", "(R, S(1))"]``."""
        return [format_placements(self.src_spec.placements)] + [format_placements(s.dst) for s in self.steps]

    def __str__(self) -> str:
        src, dst = self.src_spec, self.dst_spec
        where = f"mesh {src.mesh.short()}" if src.mesh == dst.mesh else \
            f"mesh {src.mesh.short()} {_ranks(src.mesh)} -> mesh {dst.mesh.short()} {_ranks(dst.mesh)}"
        lines = [f"reshard {src.dtype}{list(src.shape)} on {where} ({self.backend}): "
                 f"{format_placements(src.placements)} -> {format_placements(dst.placements)}"]
        rows, mesh = [], src.mesh
        for k, step in enumerate(self.steps, 1):
            what, *rest = step.columns(mesh)
            rows.append((f"{k}. {what}", *rest))
            if step.mesh_dim < 0:
                mesh = step.dst_mesh
        widths = [max((len(r[c]) for r in rows), default=0) for c in range(4)]
        for r in rows:
            cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].rjust(widths[2]), r[3].rjust(widths[3])]
            lines.append("  " + "  ".join(cells) + "   " + r[4])
        if not self.steps:
            lines.append("  nothing to do: the layouts are equal")
        n = len(self.steps)
        lines.append(f"  total: {n} step{'s' if n != 1 else ''}, {fmt_bytes(self.bytes_per_rank)} per rank, "
                     f"{fmt_seconds(self.seconds)}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        src, dst = self.src_spec, self.dst_spec
        return {"shape": list(src.shape), "dtype": src.dtype, "backend": self.backend,
                "src_mesh": src.mesh.mesh.tolist(), "dst_mesh": dst.mesh.mesh.tolist(),
                "src": [str(p) for p in src.placements], "dst": [str(p) for p in dst.placements],
                "steps": [s.to_dict() for s in self.steps], "path": self.placements_path(),
                "bytes_per_rank": self.bytes_per_rank, "seconds": self.seconds}


def _ranks(mesh: ProcessMesh) -> str:
    ids = mesh.process_ids
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"[{ids[0]}..{ids[-1]}]"
    return str(ids)
