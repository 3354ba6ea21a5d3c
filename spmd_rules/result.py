"""SpmdResult: what a rule decides for one call of an op.

``inputs``  the DistSpec every DistSpec argument must have before the local op runs (one per DistSpec
            argument, in the order ``flatten_specs`` visits the call's args and kwargs);
``outputs`` complete output DistSpecs (global shape, dtype, placements), one per output of the paddle op,
            in the op's own output order; ``None`` marks an output the op returns as ``None``;
``local_op`` None: run the paddle op itself on the local shards; otherwise the name of a local
            implementation the runtime provides (see the table in ``spmd_rules/__init__.py``);
``local_attrs`` None, or a pure callable ``(coords) -> dict`` of keyword overrides for the local call on
            the rank at those mesh coordinates (uneven shards make them rank-dependent);
``op``      the rule name (filled in by the registry).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional


def _fmt_one(spec, one_d: bool) -> str:
    if spec is None:
        return "None"
    if one_d:
        return str(spec.placements[0])
    return "[" + ", ".join(str(p) for p in spec.placements) + "]"


@dataclass(frozen=True)
class LocalShaped:
    """An output whose size depends on the input VALUES (``nonzero``, ``masked_select``...): replicated on
    every mesh dim, its global shape and dtype read from the local result (the same on every rank, since
    such a rule requires its inputs replicated). The runtime resolves it per call with ``resolve``."""
    mesh: object

    @property
    def placements(self) -> tuple:
        from autoparallel.core.placement import Replicate

        return tuple(Replicate() for _ in range(self.mesh.ndim))

    @property
    def shape(self) -> tuple:
        return ("?",)

    dtype = "data-dependent"

    def resolve(self, shape, dtype):
        from autoparallel.core.spec import DistSpec, normalize_dtype

        return DistSpec(self.mesh, self.placements, tuple(int(s) for s in shape), normalize_dtype(dtype))


@dataclass(frozen=True)
class SpmdResult:
    inputs: tuple
    outputs: tuple
    local_op: Optional[str] = None
    local_attrs: Optional[Callable] = field(default=None, compare=False)
    op: str = ""

    def __post_init__(self):
        object.__setattr__(self, "inputs", tuple(self.inputs))
        outs = self.outputs
        if not isinstance(outs, (list, tuple)):
            outs = (outs,)
        object.__setattr__(self, "outputs", tuple(outs))

    # ---- conveniences for the runtime -------------------------------------------------------------
    @property
    def output(self):
        """The single output spec (error when the op has several outputs)."""
        if len(self.outputs) != 1:
            raise ValueError(f"{self.op or 'op'} has {len(self.outputs)} outputs; use .outputs")
        return self.outputs[0]

    @property
    def mesh(self):
        for s in self.inputs + self.outputs:
            if s is not None:
                return s.mesh
        return None

    def local_kwargs(self, coords) -> dict:
        """Keyword overrides for the local call at mesh ``coords`` ({} when the op needs none)."""
        return dict(self.local_attrs(tuple(coords))) if self.local_attrs is not None else {}

    def split_mesh_dims(self) -> tuple:
        """Mesh dims on which the op is split: some required input or output placement is not R there.

        Backward convention: on such a dim an input required R gets its gradient summed over the
        dim's group (identity forward, all_reduce backward); on other dims local gradients are complete.
        """
        mesh = self.mesh
        if mesh is None:
            return ()
        dims = []
        for m in range(mesh.ndim):
            if any(s is not None and not s.placements[m].is_replicate() for s in self.inputs + self.outputs):
                dims.append(m)
        return tuple(dims)

    # ---- text ---------------------------------------------------------------------------------------
    def __str__(self) -> str:
        mesh = self.mesh
        one_d = mesh is not None and mesh.ndim == 1
        ins = "(" + ", ".join(_fmt_one(s, one_d) for s in self.inputs) + ")"
        outs = [_fmt_one(s, one_d) for s in self.outputs]
        out = outs[0] if len(outs) == 1 else "(" + ", ".join(outs) + ")"
        text = f"{ins} -> {out}"
        if self.local_op:
            text += f" via {self.local_op}"
        return text

    def __repr__(self) -> str:
        def spec(s):
            return "None" if s is None else f"{list(s.shape)} {s.dtype} {_fmt_one(s, False)}"

        ins = ", ".join(spec(s) for s in self.inputs)
        outs = ", ".join(spec(s) for s in self.outputs)
        extra = f", local_op={self.local_op!r}" if self.local_op else ""
        extra += ", local_attrs=<fn>" if self.local_attrs is not None else ""
        return f"SpmdResult({self.op or '?'}: inputs=({ins}), outputs=({outs}){extra})"
