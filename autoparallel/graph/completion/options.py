"""Knobs of the layout search and its solver, in one place (``complete(..., options=SolverOptions(...))``)."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("auto", "ilp", "exhaustive")


@dataclass(frozen=True)
class SolverOptions:
    """How completion enumerates layouts and solves for the cheapest assignment. Every default is exact:
    a knob trades search effort only where its comment says so."""

    # "auto": dynamic-programming elimination, then an integer program on the branching core;
    # "ilp": the whole problem as one integer program; "exhaustive": every combination (small checks only).
    method: str = "auto"
    # Ops with more tensor inputs than this: only the largest few drive a mesh dim when enumerating candidates
    # (fewer drivers = fewer candidate layouts per op, so a smaller problem).
    max_drivers: int = 4
    # Wall-clock limit of HiGHS on the integer program, seconds; past it the best integral solution found is
    # taken (stats["ilp_optimal"] is then False).
    ilp_time_limit: float = 120.0
    # Relative MIP gap at which HiGHS stops; 0.0 = proven optimal.
    ilp_rel_gap: float = 0.0
    # Dead-end elimination before the integer program compares each state against this many of the cheapest
    # states of the same variable (it only drops states proven never better: any value keeps an optimum).
    dominance_probes: int = 8
    # "exhaustive" refuses problems with more combinations than this.
    exhaustive_limit: int = 2_000_000

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be 'auto', 'ilp' or 'exhaustive', got {self.method!r}")
        for name in ("max_drivers", "dominance_probes", "exhaustive_limit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SolverOptions.{name} must be a positive int, got {v!r}")
        if isinstance(self.ilp_time_limit, bool) or not isinstance(self.ilp_time_limit, (int, float)) or \
                self.ilp_time_limit <= 0:
            raise ValueError(f"SolverOptions.ilp_time_limit must be a positive number of seconds, "
                             f"got {self.ilp_time_limit!r}")
        if isinstance(self.ilp_rel_gap, bool) or not isinstance(self.ilp_rel_gap, (int, float)) or \
                not 0 <= self.ilp_rel_gap < 1:
            raise ValueError(f"SolverOptions.ilp_rel_gap must be in [0, 1), got {self.ilp_rel_gap!r}")


def resolve(method: str | None, options: SolverOptions | None) -> SolverOptions:
    """The options of a call that may pass the older ``method=`` keyword, ``options=``, both or neither."""
    if options is None:
        return SolverOptions() if method is None else SolverOptions(method=method)
    if not isinstance(options, SolverOptions):
        raise TypeError(f"options must be a SolverOptions, got {type(options).__name__}")
    if method is not None and method != options.method:
        raise ValueError(f"method={method!r} contradicts options.method={options.method!r}; pass one of them")
    return options
