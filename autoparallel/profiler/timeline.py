"""Exclusive (self) time per category on one thread: every instant of a profiled region is charged to
exactly one category, the innermost one open, so the categories add up to the region's wall time.

    tl = Timeline()
    tl.enter("dispatch"); ...; tl.enter("compute.ops"); ...; tl.leave(); ...; tl.leave()
    tl.close()
    tl.seconds      # {"outside": ..., "dispatch": ..., "compute.ops": ...}
    tl.calls        # [CollectiveCall] in the order this rank issued them

Collectives are leaves: ``enter_collective`` / ``leave_collective`` (called by comm/counter.py's wrappers
or the simulated transport's) time one call and keep its record.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

OUTSIDE = "outside"          # time in no hooked region: paddle kernels, autograd, optimizer, user code


@dataclass
class CollectiveCall:
    name: str                # paddle.distributed function (or simulated transport collective)
    bytes_sent: float        # bytes this rank sent (comm/cost.py conventions)
    group_size: int
    held: float              # bytes this rank held entering the call
    ranks: tuple             # the group's global ranks (a send/recv: the pair)
    seconds: float           # wall time inside the call
    context: str             # the category open around the call ("pipeline.p2p", "reshard", ...)


class Timeline:
    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.seconds: dict = {}
        self.counts: dict = {}           # category -> times entered
        self.calls: list = []
        self.owner = threading.get_ident()
        self._stack = [OUTSIDE]
        self._last = clock()
        self._starts: list = []
        self.hook_pair_s = 0.0           # the cost of one enter/leave pair, when measured (hook_cost)

    def _charge(self, now) -> None:
        top = self._stack[-1]
        self.seconds[top] = self.seconds.get(top, 0.0) + (now - self._last)
        self._last = now

    def enter(self, category: str) -> None:
        self._charge(self.clock())
        self._stack.append(category)
        self.counts[category] = self.counts.get(category, 0) + 1

    def leave(self) -> None:
        if len(self._stack) == 1:
            raise RuntimeError("Timeline.leave without a matching enter")
        self._charge(self.clock())
        self._stack.pop()

    def enter_collective(self, name: str) -> None:
        self.enter("collective")
        self._starts.append(self._last)

    def leave_collective(self, name, bytes_sent, group_size, held, ranks) -> None:
        now = self.clock()
        context = self._stack[-2]
        self._charge(now)
        self._stack.pop()
        self.calls.append(CollectiveCall(name, float(bytes_sent), int(group_size), float(held), tuple(ranks),
                                         now - self._starts.pop(), context))

    def hook_cost(self, pairs: int = 200) -> float:
        """Seconds one enter/leave pair costs on this thread (the fastest of three runs of ``pairs``), so a
        report can say how much of a region the profile itself took. Leaves the totals untouched."""
        saved = (dict(self.seconds), dict(self.counts), self._last)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(pairs):
                self.enter("calibration")
                self.leave()
            best = min(best, (time.perf_counter() - start) / pairs)
        self.seconds, self.counts, self._last = saved
        return best

    def close(self) -> float:
        """Charge the time up to now; returns the total seconds recorded."""
        self._charge(self.clock())
        del self._stack[1:]
        return sum(self.seconds.values())
