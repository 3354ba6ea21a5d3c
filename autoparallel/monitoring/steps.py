"""Step accounting of the monitor: record keys (``name`` / ``name[index]``) and per-step totals."""
from __future__ import annotations

import re

_KEY = re.compile(r"^(.*)\[(\d+)\]$")


def _key(name: str, index) -> str:
    if not isinstance(name, str) or not name or "[" in name:
        raise ValueError(f"record name must be a non-empty str without '[', got {name!r}")
    if index is None:
        return name
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"record index must be a non-negative int, got {index!r}")
    return f"{name}[{index}]"


def indexed(timings: dict, name: str) -> list:
    """[time of name[0], name[1], ...] from a timings dict; ValueError naming any missing index."""
    found = {}
    for key, value in timings.items():
        m = _KEY.match(key)
        if m and m.group(1) == name:
            found[int(m.group(2))] = value
    if not found:
        return []
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise ValueError(f"no timings for {name} indices {missing} (recorded {sorted(found)})")
    return [found[i] for i in range(len(found))]


class _Steps:
    """Per-step totals under one way of delimiting steps (explicit ``step()`` calls, or inferred)."""

    def __init__(self, warmup: int, measure: int):
        self.warmup, self.measure = warmup, measure
        self.index = 0
        self.totals: list = []             # one {key: seconds} per measured step
        self.step_times: list = []         # seconds of the top-level records per measured step
        self.step_comm: list = []          # of which blocked in collectives
        self.current: dict = {}
        self.comm_totals: list = []        # one {key: seconds blocked in collectives} per measured step
        self.current_comm: dict = {}
        self.top = 0.0
        self.top_comm = 0.0
        self.top_keys: set = set()

    @property
    def measuring(self) -> bool:
        return self.warmup <= self.index < self.warmup + self.measure

    @property
    def done(self) -> bool:
        return self.index >= self.warmup + self.measure

    def add(self, key: str, seconds: float, top: bool, comm: float = 0.0) -> None:
        if self.measuring:
            self.current[key] = self.current.get(key, 0.0) + seconds
            if comm:
                self.current_comm[key] = self.current_comm.get(key, 0.0) + comm
            if top:
                self.top += seconds
                self.top_comm += comm

    def close(self) -> None:
        if self.measuring:
            self.totals.append(self.current)
            self.comm_totals.append(self.current_comm)
            self.step_times.append(self.top)
            self.step_comm.append(self.top_comm)
        self.current, self.current_comm, self.top, self.top_comm, self.top_keys = {}, {}, 0.0, 0.0, set()
        self.index += 1
