"""PerformanceMonitor: time what each rank does, find the imbalance, and suggest a better plan.

```python
mon = ap.PerformanceMonitor(warmup_steps=2, measure_steps=5)
for step in range(steps):
    with mon.record("step"):
        for i, layer in enumerate(layers):
            with mon.record("layer", index=i):
                x = layer(x)
    mon.step()
print(mon.report())                      # per-rank table (rank 0 sees every rank after gather())
mon.is_imbalanced(threshold=0.2)         # slowest rank or pipeline stage > 20 % above the mean
s = mon.suggest_optimal_strategy(num_stages=4)   # an ap.Strategy
s.pipeline_parallel.split_points         # balanced_split of the measured per-layer times
s.suggestion                             # the evidence: measured layer/stage times, current and new split
```

The article's loop, with no ``step()`` call (steps are inferred: a step starts when a top-level record
name repeats; see ``PerformanceMonitor``):

```python
monitor = ap.PerformanceMonitor(warmup_steps=10, measure_steps=20)
for step, batch in enumerate(loader):
    with monitor.record("forward"):
        loss = model(batch)
    with monitor.record("backward"):
        loss.backward()
    with monitor.record("step"):
        optimizer.step()
    if step == 30 and monitor.is_imbalanced():     # every rank's step time, gathered (all ranks call it)
        new_strategy = monitor.suggest_optimal_strategy()        # an ap.Strategy
        model, optimizer = ap.reconfigure_distributed_model(model, new_strategy)
```

A rank's step time is the sum of its top-level records in a step. Timings are per step: records of one key
within a measured step add up (a layer run once per micro-batch), and a key's time is the mean of its per-step
totals over the ``measure_steps`` steps that follow ``warmup_steps``. Keys are ``name`` or ``name[index]``.
``gather()`` brings every rank's timings to every rank with two all_gathers of small tensors (in one process:
just this one).
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

from autoparallel import patches
from autoparallel.config.fields import integral
from autoparallel.monitoring.report import ReportingMixin, _sort_key
from autoparallel.monitoring.steps import _KEY, _key, _Steps, indexed  # noqa: F401
from autoparallel.monitoring.suggestion import Suggestion, SuggestingMixin, even_split, skew  # noqa: F401
from autoparallel.monitoring.world import _all_gather_json, _simulated, _world_size  # noqa: F401


def _count(label: str, v, lo: int, optional: bool = False):
    """``v`` as an int >= ``lo`` (numpy ints accepted), or None when optional; ValueError naming ``label``."""
    if v is None and optional:
        return None
    n = integral(v)
    if n is None or n < lo:
        raise ValueError(f"{label} must be an int >= {lo}{' or None' if optional else ''}, got {v!r}")
    return n


def _check_args(warmup_steps, measure_steps, num_stages, split, layer_names, clock, pipeline) -> tuple:
    """The constructor's arguments checked before anything is recorded: (warmup, measure, num_stages) as ints."""
    pairs = isinstance(split, (list, tuple)) and all(
        isinstance(s, (list, tuple)) and len(s) == 2 and all(integral(x) is not None for x in s) for s in split)
    if split is not None and not pairs:
        raise TypeError(f"PerformanceMonitor: split must be a list of (first layer, end layer) pairs, one per "
                        f"stage (e.g. [(0, 2), (2, 4)]), got {split!r:.80}")
    if layer_names is not None and (isinstance(layer_names, str) or not isinstance(layer_names, (list, tuple))
                                    or not all(isinstance(n, str) for n in layer_names)):
        raise TypeError(f"PerformanceMonitor: layer_names must be a list of layer names (str), got "
                        f"{layer_names!r:.80}")
    if not callable(clock):
        raise TypeError(f"PerformanceMonitor: clock must be a callable returning seconds (time.perf_counter), got "
                        f"{type(clock).__name__} {clock!r:.60}")
    if pipeline is not None and not hasattr(pipeline, "records"):
        raise TypeError(f"PerformanceMonitor: pipeline must be a PipelineModule (ap.parallelize with pipeline "
                        f"parallelism) or None, got {type(pipeline).__name__}")
    out = (_count("warmup_steps", warmup_steps, 0), _count("measure_steps", measure_steps, 1),
           _count("num_stages", num_stages, 1, optional=True))
    if split is not None:
        _check_split(split, out[2], layer_names)
    return out


def _check_split(split, num_stages, layer_names) -> None:
    """The current split: contiguous (first, end) layer ranges from layer 0, agreeing with ``num_stages`` and
    ``layer_names`` when given (otherwise one of them would be ignored)."""
    ends = [0] + [int(b) for _, b in split]
    if not split or any(int(a) != e or int(b) <= a for (a, b), e in zip(split, ends)):
        raise ValueError(f"PerformanceMonitor: split must list contiguous, non-empty (first, end) layer ranges from "
                         f"layer 0, one per stage (e.g. [(0, 2), (2, 4)]), got {list(split)!r:.80}")
    if num_stages is not None and num_stages != len(split):
        raise ValueError(f"PerformanceMonitor: num_stages={num_stages} but split has {len(split)} stages; give one "
                         f"of them, or agreeing values")
    if layer_names is not None and len(layer_names) != ends[-1]:
        raise ValueError(f"PerformanceMonitor: layer_names has {len(layer_names)} names but split covers "
                         f"{ends[-1]} layers")


class PerformanceMonitor(SuggestingMixin, ReportingMixin):
    """Steps are delimited by ``step()`` calls, or, when the loop never calls it (the article's loop has
    only ``record`` blocks), inferred: a new step starts when a top-level record name repeats (forward,
    backward, step, forward, ... -> the second ``forward`` starts step 2; a step ends when the next begins).
    Until the first ``step()`` call both are tracked; calling ``step()`` selects explicit steps (needed when
    a name repeats at top level within one step, e.g. once per micro-batch), and once the inferred steps
    have covered ``warmup_steps + measure_steps`` they are the ones used.

    ``pipeline``: a PipelineModule whose per-stage compute times (its ``records``) each top-level record adds
    as ``stage[i]`` (default: the current run's model when it is a pipeline)."""

    def __init__(self, warmup_steps: int = 2, measure_steps: int = 10, *, num_stages: int = None,
                 split: list = None, layer_names: list = None, clock=time.perf_counter, pipeline=None):
        warmup_steps, measure_steps, num_stages = _check_args(warmup_steps, measure_steps, num_stages, split,
                                                              layer_names, clock, pipeline)
        self.warmup_steps = warmup_steps
        self.measure_steps = measure_steps
        self.num_stages = num_stages
        self.split = [tuple(s) for s in split] if split is not None else None
        self.layer_names = list(layer_names) if layer_names is not None else None
        self._clock = clock
        self.pipeline = pipeline           # a PipelineModule whose stage times to read (default: the run's)
        self._pipe_records = None
        self._explicit = _Steps(warmup_steps, measure_steps)
        self._inferred = _Steps(warmup_steps, measure_steps)
        self._mode = None                  # None (undecided), "explicit" or "inferred"
        self._depth = 0
        self._order: list = []             # keys in the order they were first recorded
        self._seen: set = set()
        self._gathered: Optional[dict] = None
        self._gathered_steps: Optional[dict] = None
        self._gathered_comm: Optional[dict] = None
        self._gathered_compute: Optional[dict] = None

    @property
    def _steps(self) -> _Steps:
        return self._explicit if self._mode == "explicit" else self._inferred

    @property
    def _totals(self) -> list:
        return self._steps.totals

    @property
    def steps_inferred(self) -> bool:
        """Whether steps are delimited by repeated record names (no ``step()`` call so far)."""
        return self._mode != "explicit"

    @property
    def measuring(self) -> bool:
        return self._steps.measuring

    @property
    def done(self) -> bool:
        return self._steps.done

    def _trackers(self) -> list:
        return {None: [self._explicit, self._inferred], "explicit": [self._explicit],
                "inferred": [self._inferred]}[self._mode]

    def _begin(self, key: str, top: bool) -> None:
        inf = self._inferred
        if self._mode == "explicit" or not top:
            return
        if key in inf.top_keys:
            inf.close()
            if self._mode is None and inf.done:
                self._mode = "inferred"
        inf.top_keys.add(key)

    @contextlib.contextmanager
    def record(self, name: str, index: int = None):
        key = _key(name, index)
        top = self._depth == 0
        if key not in self._seen:
            self._seen.add(key)
            self._order.append(key)
        self._begin(key, top)
        trackers = [t for t in self._trackers() if t.measuring]
        if trackers:
            _comm_timer.install()
        self._depth += 1
        start = self._clock() if trackers else 0.0
        comm0 = _comm_timer.seconds
        try:
            yield
        finally:
            self._depth -= 1
            if trackers:
                seconds = self._clock() - start
                for t in trackers:
                    t.add(key, seconds, top, _comm_timer.seconds - comm0)
                if top:
                    self._absorb_pipeline(trackers)

    def stop(self) -> None:
        """Put back paddle's collective functions the collective timer wraps (timings recorded so far stay; a
        later measured record installs the timer again)."""
        _comm_timer.uninstall()

    def _pipe(self):
        if self.pipeline is not None:
            return self.pipeline
        from autoparallel.auto_checkpoint import current_run

        run = current_run()
        model = run.model if run is not None else None
        return model if hasattr(model, "records") and hasattr(model, "plan") else None

    def _absorb_pipeline(self, trackers) -> None:
        """A pipeline step ran inside this record: its stages' compute time (forward, backward and weight
        actions in ``pipe.records``; transfers and waits excluded) becomes ``stage[i]`` of this step."""
        pipe = self._pipe()
        records = getattr(pipe, "records", None) if pipe is not None else None
        if not records or records is self._pipe_records:
            return
        self._pipe_records = records
        per_stage: dict = {}
        for rec in records:
            if rec.kind in ("F", "B", "W"):
                per_stage[rec.stage] = per_stage.get(rec.stage, 0.0) + rec.end - rec.start
        for stage, seconds in per_stage.items():
            for t in trackers:
                t.add(f"stage[{stage}]", seconds, False)

    def step(self) -> None:
        """End the current step (optional: without it, steps are inferred from repeated record names)."""
        if self._mode == "inferred":
            raise ValueError(f"PerformanceMonitor inferred {self._inferred.index} steps from repeated top-level "
                             f"record names before the first step() call; call step() from the first step on, "
                             f"or never (a name recorded twice at top level within one step needs step())")
        self._mode = "explicit"
        self._explicit.close()

    def timings(self) -> dict:
        """{key: mean seconds per measured step} on this rank."""
        totals = self._totals
        keys = sorted({k for t in totals for k in t})
        n = max(len(totals), 1)
        return {k: sum(t.get(k, 0.0) for t in totals) / n for k in keys}

    def comm_timings(self) -> dict:
        """{key: mean seconds per measured step spent blocked in ``paddle.distributed`` collectives} (real
        jobs; waiting for a slower peer counts here, so ``time - comm`` is what this rank computed)."""
        totals = self._steps.comm_totals
        keys = sorted({k for t in totals for k in t})
        n = max(len(totals), 1)
        return {k: sum(t.get(k, 0.0) for t in totals) / n for k in keys}

    def step_time(self) -> float:
        """Mean seconds per measured step of this rank's top-level records (0.0 before any measured step)."""
        times = self._steps.step_times
        return sum(times) / len(times) if times else 0.0

    def compute_time(self) -> float:
        """Mean seconds per measured step of the top-level records minus the time blocked in collectives:
        what this rank computed (a straggler's is larger; the others' waits are not in it)."""
        steps = self._steps
        if not steps.step_times:
            return 0.0
        return (sum(steps.step_times) - sum(steps.step_comm)) / len(steps.step_times)

    def gather(self) -> dict:
        """{rank: timings} of every rank (collective in a real job: every rank must call it). In the simulated
        world one process runs every rank on one timeline, so every rank's entry is this process's."""
        from autoparallel.checkpoint.sync import job

        multi, rank, world_size = job()
        mine = {"timings": self.timings(), "step": self.step_time(), "comm": self.comm_timings(),
                "compute": self.compute_time()}
        if not multi:
            ranks = range(world_size) if _simulated() else [rank]
            both = {r: mine for r in ranks}
        else:
            from autoparallel import watchdog

            with watchdog.op("monitor.gather"):
                both = _all_gather_json(mine, world_size)
        self._gathered = {r: v["timings"] for r, v in both.items()}
        self._gathered_steps = {r: v["step"] for r, v in both.items()}
        self._gathered_comm = {r: v["comm"] for r, v in both.items()}
        self._gathered_compute = {r: v["compute"] for r, v in both.items()}
        return self._gathered

    def _per_rank(self) -> dict:
        return self._gathered if self._gathered is not None else {0: self.timings()}

    def layer_times(self, name: str = "layer") -> list:
        """Per-layer seconds per step, merged over ranks (a layer's slowest replica)."""
        merged: dict = {}
        for timings in self._per_rank().values():
            for key, value in timings.items():
                m = _KEY.match(key)
                if m and m.group(1) == name:
                    merged[key] = max(merged.get(key, 0.0), value)
        return indexed(merged, name)

    def _stages(self, split=None) -> tuple:
        """(split, stage times) from recorded stage[i] times or from layer times and a split."""
        layers = self.layer_times()
        split = [tuple(s) for s in split] if split is not None else self.split
        if layers:
            n_stages = len(split) if split else self.num_stages
            if n_stages is None:
                return None, []
            split = split or even_split(len(layers), n_stages)
            return split, [sum(layers[a:b]) for a, b in split]
        merged: dict = {}
        for timings in self._per_rank().values():
            for key, value in timings.items():
                m = _KEY.match(key)
                if m and m.group(1) == "stage":
                    merged[key] = max(merged.get(key, 0.0), value)
        return None, indexed(merged, "stage")

    def imbalance(self, split=None) -> dict:
        """How unequal the ranks and the pipeline stages are.

        ``ranks``: the larger of the skews (slowest over mean, minus 1) of the ranks' step times and of their
        compute times (step time minus the time blocked in collectives). Synchronous training hides a
        straggler in the step times — the others wait for it in a collective — but not in the compute times.
        ``phases``: per recorded phase, how far the slowest rank's compute time exceeds the phase's mean,
        relative to the mean step time; ``slowest_rank`` is the slowest rank of the *first* phase (in record
        order) whose excess is at least half of the largest one (the cause comes before the waits it
        induces). ``stages``: the skew of the stage times (``stage[i]`` records, a pipeline's own timings, or
        ``layer[i]`` records summed over a split)."""
        steps = self._rank_step_times()
        compute = self._gathered_compute if self._gathered_compute is not None else {}
        out = {"ranks": max(skew(steps.values()), skew(compute.values())), "rank_steps": steps,
               "rank_compute": compute, "stages": 0.0, "stage_times": [], "phases": {}}
        per_rank = self._per_rank()
        mean_step = sum(steps.values()) / len(steps) if steps else 0.0
        if len(per_rank) > 1 and mean_step > 0:
            comm = self._gathered_comm if self._gathered_comm is not None else {}
            keys = [k for k in self._key_order() if any(k in t for t in per_rank.values())]
            phase = {r: {k: t.get(k, 0.0) - comm.get(r, {}).get(k, 0.0) for k in keys} for r, t in per_rank.items()}
            for key in keys:
                vals = [c[key] for c in phase.values()]
                out["phases"][key] = (max(vals) - sum(vals) / len(vals)) / mean_step
            worst = max(out["phases"].values(), default=0.0)
            if worst > 0:
                first = next(k for k in keys if out["phases"][k] >= 0.5 * worst)
                out["slowest_phase"] = first
                out["slowest_rank"] = max(phase, key=lambda r: phase[r][first])
        _, stage_times = self._stages(split)
        if stage_times:
            out["stages"] = skew(stage_times)
            out["stage_times"] = stage_times
            out["slowest_stage"] = max(range(len(stage_times)), key=stage_times.__getitem__)
        if steps and "slowest_rank" not in out:
            out["slowest_rank"] = max(steps, key=steps.get)
        return out

    def _key_order(self) -> list:
        order = list(self._order)
        return order + sorted({k for t in self._per_rank().values() for k in t} - set(order), key=_sort_key)

    def _rank_step_times(self) -> dict:
        """{rank: mean seconds of the top-level records per measured step}."""
        if self._gathered_steps is not None:
            return dict(self._gathered_steps)
        return {0: self.step_time()} if self._totals else {}

    def _gather_if_job(self) -> None:
        from autoparallel.checkpoint.sync import job

        if job()[0] or _simulated():
            self.gather()

    def is_imbalanced(self, threshold: float = 0.2, split=None) -> bool:
        """Whether the slowest rank's step time, or the slowest pipeline stage (from ``stage[i]`` / ``layer[i]``
        records), exceeds the mean by more than ``threshold``. In a real job this gathers every rank's
        timings first, so every rank must call it (as the article's loop does, at the same step)."""
        if not threshold >= 0:
            raise ValueError(f"threshold must be a non-negative fraction, got {threshold!r}")
        if not self._totals:
            raise ValueError(f"no measured step yet ({self.warmup_steps} warm-up + {self.measure_steps} measured "
                             f"steps; with inferred steps a step ends when the next one starts): call "
                             f"is_imbalanced() once monitor.done")
        self._gather_if_job()
        imb = self.imbalance(split)
        return imb["ranks"] > threshold or imb["stages"] > threshold


class _CommTimer:
    """Seconds this process spends inside blocking ``paddle.distributed`` collectives (installed by the first
    measured record: each call is wrapped with two clock reads). An asynchronous call counts until it
    returns; its later ``wait()`` does not. The wrappers go through the patch ledger: ``ap.uninstall()`` or
    ``uninstall()`` (``PerformanceMonitor.stop()``) puts paddle's functions back."""

    NAMES = ("all_gather", "all_reduce", "broadcast", "send", "recv", "reduce_scatter", "alltoall",
             "alltoall_single", "barrier")

    def __init__(self):
        self._own = 0.0
        self.installed = False
        self._wrapped: dict = {}            # name -> (our wrapper, the raw value it replaced)

    @property
    def seconds(self) -> float:
        """Inside the wrapped calls, plus waiting in collective agreement checks (comm/agreement.py: paddle's own
        all_gather, outside the namespace these wrappers cover)."""
        from autoparallel.comm import agreement

        return self._own + agreement.stats()["seconds"]

    def install(self) -> None:
        import paddle.distributed as dist

        if self.installed and _timed(dist.all_reduce):
            return                                  # (another wrapper may have restored the originals)

        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None and not _timed(fn):
                raw = dist.__dict__.get(name, patches.MISSING)
                wrapper = self._wrap(fn)
                patches.patch(dist, name, wrapper)
                self._wrapped[name] = (wrapper, raw)
        self.installed = True

    def uninstall(self) -> int:
        """Put back the collectives this timer still wraps; returns how many."""
        import paddle.distributed as dist

        n = 0
        for name, (wrapper, raw) in self._wrapped.items():
            if dist.__dict__.get(name) is wrapper:
                patches.put_back(dist, name, raw)
                n += 1
        self._wrapped.clear()
        self.installed = False
        return n

    def _wrap(self, fn):
        import functools

        @patches.pass_through
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._own += time.perf_counter() - start

        timed._ap_comm_timed = True
        return timed


def _timed(fn) -> bool:
    """Whether ``fn`` or a function it wraps (``functools.wraps`` chains) is our timer."""
    for _ in range(8):
        if fn is None:
            return False
        if getattr(fn, "_ap_comm_timed", False):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


_comm_timer = _CommTimer()
