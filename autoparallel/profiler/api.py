"""``ap.profile``: where one training step goes, per rank.

```python
with ap.profile() as p:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step(); opt.clear_grad()
print(p.table())           # per rank: compute, dispatch overhead, reshards, collectives, waiting, bubble
p.plot("step.png")         # stacked bars per rank
p.breakdowns[0].collectives["all_reduce"]     # {"count", "bytes", "seconds", "wait"}
averaged([p1, p2, p3]).table()  # the mean of several profiled steps (from autoparallel.profiler)
```

In a real multi-rank job every rank must open the profile around the same code: on exit the ranks
exchange their records (two all_gathers of small tensors, not counted) so every rank, rank 0 included,
holds every rank's breakdown; ``gather=False`` keeps this rank's own. In ``ap.simulate`` one process plays
every rank: one row, ``rank -1`` ("sim"), with the in-process collectives timed as such. A region that
raises is not exchanged (a peer may be gone), and the hooks are removed either way.
"""
from __future__ import annotations

import time

from autoparallel.profiler import breakdown, hooks, report
from autoparallel.profiler.timeline import Timeline

_ACTIVE = []


class Profile:
    def __init__(self, gather: bool = True, cluster=None):
        if not isinstance(gather, bool):
            raise TypeError(f"profile(gather=...) expects a bool, got {gather!r}")
        if cluster is not None:                        # a malformed cluster is refused now, not after the step
            from autoparallel.planner.cluster import parse_cluster

            parse_cluster(cluster)
        self.gather = gather
        self.cluster = cluster
        self.breakdowns: dict = {}
        self.records: dict = {}
        self.log = None
        self._tl = None
        self._hooks = None

    # ---- the region -------------------------------------------------------------------------------------
    def start(self) -> "Profile":
        if _ACTIVE:
            raise RuntimeError("ap.profile is already open on this process; profiles do not nest")
        from autoparallel.comm.world import current_world

        self._world = current_world()
        self._tl = Timeline()
        self._tl.hook_pair_s = self._tl.hook_cost()
        self._hooks = hooks.installed(self._tl)
        self.log = self._hooks.__enter__()
        _ACTIVE.append(self)
        self._t0 = time.perf_counter()
        self._tl._last = self._t0
        return self

    def stop(self, failed: bool = False) -> "Profile":
        if self._tl is None or self not in _ACTIVE:
            raise RuntimeError("profile.stop() without start()")
        step_s = time.perf_counter() - self._t0
        self._tl.close()
        _ACTIVE.remove(self)
        self._hooks.__exit__(None, None, None)
        if failed:
            return self
        world = self._world
        rank = -1 if world.is_simulated else world.rank
        rec = breakdown.record_of(rank, step_s, self._tl)
        rec["simulated"] = world.is_simulated
        self.records = self._exchange(rec, world)
        self.breakdowns = breakdown.build_all(self.records, self._cluster())
        return self

    def __enter__(self) -> "Profile":
        return self.start()

    def __exit__(self, exc_type, exc, tb):
        self.stop(failed=exc_type is not None)
        return False

    # ---- results ----------------------------------------------------------------------------------------
    def table(self) -> str:
        self._require()
        return report.table(self.breakdowns)

    def plot(self, path: str) -> str:
        self._require()
        if not isinstance(path, str) or not path:
            raise ValueError(f"profile.plot(path) expects a file path, got {path!r}")
        return report.plot(self.breakdowns, path)

    def to_dict(self) -> dict:
        self._require()
        return {str(r): {"step_s": b.step_s, "parts": b.parts, "collectives": b.collectives, "counts": b.counts}
                for r, b in self.breakdowns.items()}

    def __str__(self) -> str:
        return self.table() if self.breakdowns else "ap.profile (no completed region)"

    def _require(self) -> None:
        if not self.breakdowns:
            raise RuntimeError("the profile has no completed region: use it as `with ap.profile() as p: ...` "
                               "(or p.start() ... p.stop()) first")

    def _cluster(self):
        if self.cluster is not None:
            from autoparallel.planner.cluster import parse_cluster

            return parse_cluster(self.cluster)
        from autoparallel.comm import world
        from autoparallel.planner.profiles import default_profile

        if world._cluster_override is not None:       # ap.set_cluster(...)
            return world._cluster_override
        return default_profile(self._world.backend)   # gloo: the calibrated CPU profile

    def _exchange(self, rec: dict, world) -> dict:
        if world.is_simulated or not self.gather or world.world_size == 1:
            return {rec["rank"]: rec}
        from autoparallel.monitor import _all_gather_json

        return {int(r): v for r, v in _all_gather_json(rec, world.world_size).items()}


def averaged(profiles, how: str = "mean") -> Profile:
    """One Profile whose breakdowns summarise several completed ones (the same ranks in each): ``how="mean"``
    the means, ``how="median"`` per rank the region of median step time. Profile a few steps, report one."""
    profiles = list(profiles)
    for q in profiles:
        if not isinstance(q, Profile):
            raise TypeError(f"averaged() expects ap.profile objects, got {type(q).__name__}")
        q._require()
    out = Profile(gather=False)
    out.breakdowns = breakdown.average([q.breakdowns for q in profiles], how)
    return out


def profile(gather: bool = True, cluster=None) -> Profile:
    """A step-time profiler: ``with ap.profile() as p: <one training step>``; then ``p.table()``,
    ``p.plot(path)``. ``cluster``: the profile (ClusterSpec, spec string or path) whose calibrated collective
    fits price transfers when the other ranks' records are missing; default the one set by ``ap.set_cluster``, else the built-in profile of the backend (gloo: the calibrated
    CPU profile)."""
    return Profile(gather=gather, cluster=cluster)
