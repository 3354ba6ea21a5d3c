"""Backend capability table: which collectives, reduce ops and dtypes a backend runs natively, and how
a missing capability is emulated. Pure data: the reshard planner and the cost model price emulations
from it; the runtime (comm/collectives.py) executes them.

Measured on paddle 3.3.1 CPU (gloo): reduce_scatter, alltoall and alltoall_single raise
"ProcessGroupGLOO does not support ..."; ReduceOp.AVG fails; an fp16 all_reduce returns inf;
sync_op=False still blocks (no overlap).
"""
from __future__ import annotations

from dataclasses import dataclass, field

COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast", "send_recv")

# How each missing collective is emulated, and the collectives the emulation runs.
#   reduce_scatter -> all_reduce then local slice   (moves 2(n-1)/n·b instead of (n-1)/n·b)
#   all_to_all     -> pairwise send/recv in n-1 perfect-matching rounds (same bytes, n-1 latencies);
#                     odd groups have no perfect matching: all_gather of every chunk ((n-1)·b bytes).
#                     (gloo matches point-to-point messages by a per-group op counter, so every member
#                     must issue the same number of sends and recvs in the same order.)
EMULATIONS = {
    "reduce_scatter": ("all_reduce", "slice"),
    "all_to_all": ("send_recv",),
}


@dataclass(frozen=True)
class Capabilities:
    backend: str
    collectives: frozenset                      # collectives the backend runs natively
    reduce_ops: frozenset                       # reduce ops all_reduce accepts natively
    exact_reduce_dtypes: frozenset              # dtypes whose all_reduce is exact (others reduced in fp32)
    overlap: bool                               # does sync_op=False overlap with compute?
    notes: tuple = field(default_factory=tuple)

    def has(self, collective: str) -> bool:
        return collective in self.collectives or collective in ("slice", "local")

    def emulation(self, collective: str):
        """None if native, else the tuple of collectives that emulate it."""
        if self.has(collective):
            return None
        if collective not in EMULATIONS:
            raise NotImplementedError(f"backend {self.backend!r} has no {collective!r} and no emulation is known")
        return EMULATIONS[collective]

    def reduce_natively(self, reduce_type: str) -> bool:
        return reduce_type in self.reduce_ops

    def reduce_dtype(self, dtype: str) -> str:
        """The dtype a reduction of ``dtype`` is carried out in on this backend."""
        return dtype if dtype in self.exact_reduce_dtypes else "float32"


_ALL_FLOAT = frozenset({"float64", "float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool"})

CAPABILITIES = {
    "nccl": Capabilities("nccl", frozenset(COLLECTIVES), frozenset({"sum", "avg", "max", "min"}), _ALL_FLOAT, True),
    "gloo": Capabilities(
        "gloo",
        frozenset({"all_gather", "all_reduce", "broadcast", "send_recv"}),
        frozenset({"sum", "max", "min"}),
        frozenset({"float64", "float32", "int64", "int32", "int8", "uint8", "bool"}),
        False,
        notes=("reduce_scatter/alltoall/alltoall_single unsupported in paddle 3.3.1",
               "ReduceOp.AVG fails: sum then scale", "fp16 all_reduce returns inf: reduce in fp32",
               "sync_op=False blocks: no overlap", "per-collective timeout fixed at 30 s"),
    ),
    # the simulated world computes every collective in-process; it can do everything
    "sim": Capabilities("sim", frozenset(COLLECTIVES), frozenset({"sum", "avg", "max", "min"}), _ALL_FLOAT, False),
}


def capabilities(backend: str) -> Capabilities:
    if backend not in CAPABILITIES:
        raise ValueError(f"unknown backend {backend!r}: expected one of {sorted(CAPABILITIES)}")
    return CAPABILITIES[backend]
