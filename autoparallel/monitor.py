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
import json
import re
import time
from dataclasses import dataclass, field
from typing import Optional

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


def even_split(num_layers: int, num_stages: int) -> list:
    """The naive split: stage sizes as equal as possible (the first ``num_layers % num_stages`` one larger)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} non-empty stages")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        stop = start + base + (1 if s < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def skew(values) -> float:
    """How far the largest value exceeds the mean, relative to the mean (0 when all are equal)."""
    values = [float(v) for v in values]
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return max(values) / mean - 1.0 if mean > 0 else 0.0


@dataclass
class Suggestion:
    num_stages: int = 0
    layer_times: list = field(default_factory=list)      # measured seconds per layer per step
    current_split: list = field(default_factory=list)    # [(start, stop)] per stage
    split: list = field(default_factory=list)            # the optimal contiguous split of layer_times
    current_stage_times: list = field(default_factory=list)
    stage_times: list = field(default_factory=list)
    split_points: Optional[list] = None   # layer names starting stages 1.. (with layer_names)
    plan: object = None                   # ap.plan result re-run with the measured profile
    cluster: object = None                # the cluster rescaled to the measured step time
    strategy: Optional[dict] = None       # the plan's best configuration as a strategy dict
    notes: list = field(default_factory=list)

    @property
    def speedup(self) -> float:
        """Bottleneck stage time of the current split over that of the suggested one."""
        if not self.stage_times or max(self.stage_times) <= 0:
            return 1.0
        return max(self.current_stage_times) / max(self.stage_times)

    def __str__(self) -> str:
        if not self.num_stages:
            return "\n".join(self.notes) or "no pipeline split measured"
        lines = [f"pipeline split over {self.num_stages} stages: current {self.current_split} "
                 f"(slowest stage {max(self.current_stage_times) * 1e3:.2f} ms) -> suggested {self.split} "
                 f"(slowest stage {max(self.stage_times) * 1e3:.2f} ms, {self.speedup:.2f}x)"]
        if self.split_points:
            lines.append(f"split_points = {self.split_points}")
        lines.extend(self.notes)
        return "\n".join(lines)


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


class PerformanceMonitor:
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
        for label, v in (("warmup_steps", warmup_steps), ("measure_steps", measure_steps)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if label == "warmup_steps" else 1):
                raise ValueError(f"{label} must be an int >= {0 if label == 'warmup_steps' else 1}, got {v!r}")
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

    # ---- recording ----------------------------------------------------------------------------------
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

    # ---- results --------------------------------------------------------------------------------------
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

    # ---- suggestions ------------------------------------------------------------------------------------
    def suggest_split(self, num_stages: int = None, *, current_split=None, model=None, cluster=None,
                      global_batch_size: int = None, seq_len: int = None, current=None) -> Suggestion:
        """The pipeline split minimising the slowest stage of the measured per-layer times (balanced_split),
        and, given a planner model (preset or ModelSpec), ``global_batch_size`` and the ``current``
        configuration ("dp=2,tp=2,pp=2"), ``ap.plan`` re-run on a cluster whose device and link rates are
        scaled so that its prediction for the current configuration is the measured step time."""
        from autoparallel.parallel.pipeline.split import balanced_split

        layers = self.layer_times()
        names = self.layer_names
        split = [tuple(s) for s in current_split] if current_split is not None else self.split
        if not layers:
            est = self._pipeline_layers()
            if est is None:
                raise ValueError("no per-layer timings: record them with mon.record('layer', index=i) (or run a "
                                 "pipeline built by ap.parallelize inside a record)")
            layers, bounds, names = est
            split = split or bounds
        k = num_stages or (len(split) if split else self.num_stages)
        if k is None:
            raise ValueError("give num_stages (or a current split) to suggest a pipeline split")
        split = split or even_split(len(layers), k)
        if len(split) != k:
            raise ValueError(f"the current split has {len(split)} stages, num_stages is {k}")
        best = [tuple(s) for s in balanced_split(layers, k)]
        out = Suggestion(k, layers, split, best, [sum(layers[a:b]) for a, b in split],
                         [sum(layers[a:b]) for a, b in best])
        if names is not None:
            if len(names) != len(layers):
                raise ValueError(f"layer_names has {len(names)} names for {len(layers)} timed layers")
            out.split_points = [names[a] for a, _ in best[1:]]
        if model is not None:
            self._replan(out, model, cluster, global_batch_size, seq_len, current)
        return out

    def _pipeline_layers(self):
        """(estimated seconds per layer, current bounds, layer names) from a pipeline's measured stage times:
        each stage's time spread evenly over its layers (no per-layer records); None without a pipeline."""
        pipe = self._pipe()
        plan = getattr(pipe, "plan", None)
        if plan is None:
            return None
        _, stage_times = self._stages()
        bounds = [tuple(b) for b in plan.bounds]
        if len(stage_times) != len(bounds):
            return None
        layers = []
        for (a, b), t in zip(bounds, stage_times):
            layers.extend([t / (b - a)] * (b - a))
        return layers, bounds, list(plan.pieces.layer_names)

    def suggest_optimal_strategy(self, num_stages: int = None, *, strategy=None, current_split=None, model=None,
                                 cluster=None, global_batch_size: int = None, seq_len: int = None,
                                 current=None):
        """A ``Strategy`` for the rest of the run, from what was measured (collective in a real job: every
        rank's timings are gathered first). Its ``.suggestion`` holds the evidence (``Suggestion``).

        * Per-layer timings (``record("layer", index=i)``) and a stage count (``num_stages``, the monitor's,
          or the strategy's ``pipeline_parallel.degree``): the pipeline re-split minimising the slowest
          stage, as ``pipeline_parallel.split_points`` (layer names from ``layer_names`` or the model's
          repeated block list).
        * Otherwise the planner re-run (``ap.plan``) on the cluster rescaled so that its prediction for the
          current configuration equals the slowest rank's measured step time; its best configuration
          becomes the strategy (AMP, checkpoint and seed settings are kept).

        ``strategy`` (the current one) and ``model`` default to the current run's (the last entry point's);
        ``global_batch_size`` / ``seq_len`` default to the last input batch the model saw."""
        from autoparallel.auto_checkpoint import current_run
        from autoparallel.strategy import Strategy

        self._gather_if_job()
        run = current_run()
        base = strategy if strategy is not None else (run.strategy if run is not None else None)
        base = Strategy() if base is None else base
        if not isinstance(base, Strategy):
            raise TypeError(f"strategy must be an ap.Strategy, got {type(base).__name__}")
        base = base.copy()
        run_model = run.model if run is not None else None
        pipe_est = None if self.layer_times() else self._pipeline_layers()
        if (self.layer_times() or pipe_est) and model is None:
            pp = base.pipeline_parallel
            k = num_stages or (len(current_split) if current_split else None) or (
                len(self.split) if self.split else None) or self.num_stages or (
                len(pipe_est[1]) if pipe_est else None) or (pp.degree * pp.vpp_degree if pp.degree > 1 else None)
            if k is None:
                raise ValueError("per-layer timings but no stage count: give num_stages, or a strategy with "
                                 "pipeline_parallel.degree > 1")
            sug = self.suggest_split(k, current_split=current_split)
            _apply_split(base, sug, run_model)
            return _with_suggestion(base, sug, _world_size() if run is not None else None)
        if not self._totals:
            raise ValueError("no measured step yet: suggest_optimal_strategy() needs the monitor to be done")
        sug = Suggestion()
        planner_model = model if model is not None else _planner_model(run_model)
        if global_batch_size is None or seq_len is None:
            shape = getattr(run, "input_shape", None) if run is not None else None
            if shape:
                k = base.gradient_accumulation_steps if base.pipeline_parallel.degree == 1 else 1
                global_batch_size = global_batch_size or shape[0] * k
                seq_len = seq_len or (shape[1] if len(shape) > 1 else None)
        if current is None:
            current = _current_config(base)
        self._replan(sug, planner_model, cluster, global_batch_size, seq_len, current, world=_world_size())
        if sug.strategy is None:
            raise ValueError(f"the planner found no feasible configuration: {sug.plan}")
        return _with_suggestion(_merge(base, sug.strategy), sug, _world_size() if run is not None else None)

    def _replan(self, out: Suggestion, model, cluster, global_batch_size, seq_len, current, world=None) -> None:
        from dataclasses import replace

        from autoparallel.planner.api import plan
        from autoparallel.planner.cluster import default_cluster, parse_cluster

        if global_batch_size is None or current is None:
            raise ValueError("re-planning needs global_batch_size and the current configuration, e.g. "
                             "current='dp=2,tp=2,pp=2'")
        steps = list(self._rank_step_times().values())
        if not steps or max(steps) <= 0:
            raise ValueError("re-planning needs measured step times: wrap the step's phases in mon.record(...)")
        measured = max(steps)
        cluster = default_cluster() if cluster is None else parse_cluster(cluster)
        if world is not None and world != cluster.world_size:
            from autoparallel.planner.api import _cluster_for_world

            cluster = _cluster_for_world(cluster, world)
        predicted = plan(model, cluster, global_batch_size, seq_len, fixed=current).best.step_time_s
        scale = measured / predicted
        dev = cluster.device

        def link(spec):
            return replace(spec, latency_s=spec.latency_s * scale, bandwidth_Bps=spec.bandwidth_Bps / scale)

        measured_cluster = replace(
            cluster, name=f"{cluster.name} (measured)",
            device=replace(dev, peak_flops=tuple((d, f / scale) for d, f in dev.peak_flops),
                           memory_bandwidth_Bps=dev.memory_bandwidth_Bps / scale),
            intra_node=link(cluster.intra_node), inter_node=link(cluster.inter_node))
        out.cluster = measured_cluster
        out.plan = plan(model, measured_cluster, global_batch_size, seq_len, split=["even"], ep=[1])   # runnable
        runnable = [c for c in out.plan.candidates        # a pipeline runs at least pp micro-batches (1F1B)
                    if c.config.pp == 1 or c.num_micro_batches >= c.config.pp]
        if runnable:
            out.strategy = runnable[0].to_strategy_dict()
        out.notes.append(f"planner: measured {measured:.4g} s per step vs {predicted:.4g} s predicted for "
                         f"{current}; re-planned with every device and link rate scaled by 1/{scale:.3g}")

    # ---- reporting -----------------------------------------------------------------------------------------
    def report(self, png: str = None) -> str:
        per_rank = self._per_rank()
        ranks = sorted(per_rank)
        keys = sorted({k for t in per_rank.values() for k in t}, key=_sort_key)
        width = max([len(k) for k in keys] + [8])
        lines = [f"PerformanceMonitor: mean ms per step over {len(self._totals)} measured steps "
                 f"(after {self.warmup_steps} warm-up)",
                 f"{'key':<{width}}  " + "  ".join(f"{'rank ' + str(r):>9}" for r in ranks)]
        for k in keys:
            lines.append(f"{k:<{width}}  " + "  ".join(
                f"{per_rank[r][k] * 1e3:9.3f}" if k in per_rank[r] else f"{'-':>9}" for r in ranks))
        imb = self.imbalance()
        if imb["rank_steps"]:
            lines.append(f"rank skew of 'step': {imb['ranks'] * 100:.1f}% (slowest rank {imb.get('slowest_rank')})")
        if imb["stage_times"]:
            stages = ", ".join(f"{t * 1e3:.2f}" for t in imb["stage_times"])
            lines.append(f"stage times (ms): {stages}; skew {imb['stages'] * 100:.1f}% "
                         f"(slowest stage {imb.get('slowest_stage')})")
        text = "\n".join(lines)
        if png is not None:
            _plot(per_rank, keys, png)
        return text


class _CommTimer:
    """Seconds this process spends inside blocking ``paddle.distributed`` collectives (installed by the first
    measured record: each call is wrapped with two clock reads). An asynchronous call counts until it
    returns; its later ``wait()`` does not."""

    NAMES = ("all_gather", "all_reduce", "broadcast", "send", "recv", "reduce_scatter", "alltoall",
             "alltoall_single", "barrier")

    def __init__(self):
        self.seconds = 0.0
        self.installed = False

    def install(self) -> None:
        import paddle.distributed as dist

        if self.installed and _timed(dist.all_reduce):
            return                                  # (another wrapper may have restored the originals)

        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None and not _timed(fn):
                setattr(dist, name, self._wrap(fn))
        self.installed = True

    def _wrap(self, fn):
        import functools

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

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


def _simulated() -> bool:
    from autoparallel.comm.world import current_world

    return current_world().is_simulated


def _world_size() -> int:
    from autoparallel.comm.world import current_world

    return current_world().world_size


def _current_config(strategy) -> str:
    d = strategy.validate(world_size=_world_size())
    if d is None:
        raise ValueError("auto_mode='full': give current='dp=..,tp=..,pp=..' (the configuration the planner chose)")
    return f"dp={d.dp},tp={d.tp},pp={d.pp}"


def _planner_model(model):
    """A fresh, unallocated copy of the run's model for the planner's trace (``type(model)(model.config)``
    under ``paddle.LazyGuard``; the generators are left as they were)."""
    config = getattr(model, "config", None)
    if model is None or config is None:
        raise ValueError("re-planning needs the model: pass model= (a planner preset such as 'gpt3-1.3b', a "
                         "ModelSpec, or a paddle model), or set up a model with a .config through ap.parallelize / "
                         "ap.DataParallel")
    import paddle

    rng = paddle.get_rng_state()
    try:
        with paddle.LazyGuard():
            return type(model)(config)
    finally:
        paddle.set_rng_state(rng)


def _blocks(model, count: int) -> Optional[list]:
    """Names of the model's repeated block list with ``count`` entries ("blocks.0", ...), if it has one."""
    import paddle

    if model is None:
        return None
    for name, layer in model.named_sublayers():
        if isinstance(layer, paddle.nn.LayerList) and len(layer) == count:
            return [f"{name}.{i}" for i in range(count)]
    return None


def _apply_split(strategy, sug: Suggestion, model) -> None:
    names = sug.split_points
    if names is None:
        blocks = _blocks(model, len(sug.layer_times))
        if blocks is None:
            raise ValueError(f"cannot name the suggested split {sug.split}: give the monitor layer_names (one per "
                             f"timed layer) or set up a model whose block list has {len(sug.layer_times)} layers")
        names = sug.split_points = [blocks[a] for a, _ in sug.split[1:]]
    pp = strategy.pipeline_parallel
    if pp.degree * pp.vpp_degree == sug.num_stages:
        pp.split_points = names if sug.num_stages > 1 else []
        return
    if pp.vpp_degree > 1:
        raise ValueError(f"a {sug.num_stages}-stage split does not fit pipeline_parallel.degree={pp.degree} x "
                         f"vpp_degree={pp.vpp_degree}")
    if pp.degree != sug.num_stages:
        dp = strategy.data_parallel.degree
        if dp is not None:
            if (dp * pp.degree) % sug.num_stages:
                raise ValueError(f"a {sug.num_stages}-stage split does not fit data_parallel.degree={dp} x "
                                 f"pipeline_parallel.degree={pp.degree}")
            strategy.data_parallel.degree = dp * pp.degree // sug.num_stages
        pp.degree = sug.num_stages
    pp.split_points = names if sug.num_stages > 1 else []


def _merge(base, planned: dict):
    """``base`` with the planner's parallel configuration (its AMP, checkpoint and seed settings kept)."""
    from autoparallel.strategy import Strategy

    d = base.to_dict()
    for key, value in planned.items():
        if isinstance(value, dict) and isinstance(d.get(key), dict):
            d[key] = {**d[key], **value}
        else:
            d[key] = value
    d["auto_mode"] = "semi"
    return Strategy.from_dict(d)


def _with_suggestion(strategy, sug: Suggestion, world_size=None):
    """The suggested strategy, checked (``Strategy.validate``; on the run's world size when the monitor
    watches a run set up in this process), with its evidence."""
    strategy.validate(world_size=world_size)
    object.__setattr__(strategy, "suggestion", sug)
    return strategy


def _sort_key(key: str):
    m = _KEY.match(key)
    return (m.group(1), int(m.group(2))) if m else (key, -1)


def _plot(per_rank: dict, keys: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted(per_rank)
    fig, ax = plt.subplots(figsize=(max(6, len(keys) * 0.6), 4))
    width = 0.8 / max(len(ranks), 1)
    for j, r in enumerate(ranks):
        ax.bar([i + j * width for i in range(len(keys))], [per_rank[r].get(k, 0.0) * 1e3 for k in keys],
               width=width, label=f"rank {r}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
    ax.set_xticklabels(keys, rotation=45, ha="right")
    ax.set_ylabel("ms per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _all_gather_json(obj, world_size: int) -> dict:
    """{rank: obj} from every rank: all_gather of the payload lengths, then of the padded payloads."""
    import numpy as np
    import paddle
    import paddle.distributed as dist

    payload = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).astype(np.int32)
    lengths = []
    dist.all_gather(lengths, paddle.to_tensor([len(payload)], dtype="int64"))
    size = max([int(t.numpy()[0]) for t in lengths] + [1])
    padded = np.zeros(size, dtype=np.int32)
    padded[:len(payload)] = payload
    parts = []
    dist.all_gather(parts, paddle.to_tensor(padded))
    out = {}
    for r, (n, part) in enumerate(zip(lengths, parts)):
        data = part.numpy()[:int(n.numpy()[0])].astype(np.uint8).tobytes()
        out[r] = json.loads(data.decode())
    return out
