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
s = mon.suggest_optimal_strategy(num_stages=4)
s.split                                  # balanced_split of the measured per-layer times
```

Timings are per step: records of one key within a measured step add up (a layer run once per
micro-batch), and a key's time is the mean of its per-step totals over the ``measure_steps`` steps that
follow ``warmup_steps``. Keys are ``name`` or ``name[index]``. ``gather()`` brings every rank's timings
to every rank with two all_gathers of small tensors (in one process: just this one).
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
    num_stages: int
    layer_times: list                     # measured seconds per layer per step
    current_split: list                   # [(start, stop)] per stage
    split: list                           # the optimal contiguous split of layer_times
    current_stage_times: list
    stage_times: list
    split_points: Optional[list] = None   # layer names starting stages 1.. (with layer_names)
    plan: object = None                   # ap.plan result re-run with the measured profile
    cluster: object = None                # the cluster rescaled to the measured step time
    strategy: Optional[dict] = None       # the plan's best configuration as a strategy dict
    notes: list = field(default_factory=list)

    @property
    def speedup(self) -> float:
        """Bottleneck stage time of the current split over that of the suggested one."""
        return max(self.current_stage_times) / max(self.stage_times) if max(self.stage_times) > 0 else 1.0

    def __str__(self) -> str:
        lines = [f"pipeline split over {self.num_stages} stages: current {self.current_split} "
                 f"(slowest stage {max(self.current_stage_times) * 1e3:.2f} ms) -> suggested {self.split} "
                 f"(slowest stage {max(self.stage_times) * 1e3:.2f} ms, {self.speedup:.2f}x)"]
        if self.split_points:
            lines.append(f"split_points = {self.split_points}")
        lines.extend(self.notes)
        return "\n".join(lines)


class PerformanceMonitor:
    def __init__(self, warmup_steps: int = 2, measure_steps: int = 10, *, num_stages: int = None,
                 split: list = None, layer_names: list = None, clock=time.perf_counter):
        for label, v in (("warmup_steps", warmup_steps), ("measure_steps", measure_steps)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if label == "warmup_steps" else 1):
                raise ValueError(f"{label} must be an int >= {0 if label == 'warmup_steps' else 1}, got {v!r}")
        self.warmup_steps = warmup_steps
        self.measure_steps = measure_steps
        self.num_stages = num_stages
        self.split = [tuple(s) for s in split] if split is not None else None
        self.layer_names = list(layer_names) if layer_names is not None else None
        self._clock = clock
        self._step = 0
        self._totals: list = []            # one {key: seconds} per measured step
        self._current: dict = {}
        self._gathered: Optional[dict] = None

    # ---- recording ----------------------------------------------------------------------------------
    @property
    def measuring(self) -> bool:
        return self.warmup_steps <= self._step < self.warmup_steps + self.measure_steps

    @property
    def done(self) -> bool:
        return self._step >= self.warmup_steps + self.measure_steps

    @contextlib.contextmanager
    def record(self, name: str, index: int = None):
        key = _key(name, index)
        if not self.measuring:
            yield
            return
        start = self._clock()
        try:
            yield
        finally:
            self._current[key] = self._current.get(key, 0.0) + self._clock() - start

    def step(self) -> None:
        if self.measuring:
            self._totals.append(self._current)
        self._current = {}
        self._step += 1

    # ---- results --------------------------------------------------------------------------------------
    def timings(self) -> dict:
        """{key: mean seconds per measured step} on this rank."""
        keys = sorted({k for t in self._totals for k in t})
        n = max(len(self._totals), 1)
        return {k: sum(t.get(k, 0.0) for t in self._totals) / n for k in keys}

    def gather(self) -> dict:
        """{rank: timings} of every rank (collective in a real job: every rank must call it)."""
        from autoparallel.checkpoint.sync import job

        multi, rank, world_size = job()
        mine = self.timings()
        if not multi:
            self._gathered = {rank: mine}
            return self._gathered
        from autoparallel import watchdog

        with watchdog.op("monitor.gather"):
            self._gathered = _all_gather_json(mine, world_size)
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
        """Skews (slowest over mean, minus 1) across ranks of the "step" time and across pipeline stages."""
        per_rank = self._per_rank()
        steps = {r: t["step"] for r, t in per_rank.items() if "step" in t}
        out = {"ranks": skew(steps.values()), "rank_steps": steps, "stages": 0.0, "stage_times": []}
        _, stage_times = self._stages(split)
        if stage_times:
            out["stages"] = skew(stage_times)
            out["stage_times"] = stage_times
            out["slowest_stage"] = max(range(len(stage_times)), key=stage_times.__getitem__)
        if steps:
            out["slowest_rank"] = max(steps, key=steps.get)
        return out

    def is_imbalanced(self, threshold: float = 0.2, split=None) -> bool:
        if not threshold >= 0:
            raise ValueError(f"threshold must be a non-negative fraction, got {threshold!r}")
        imb = self.imbalance(split)
        return imb["ranks"] > threshold or imb["stages"] > threshold

    # ---- suggestions ------------------------------------------------------------------------------------
    def suggest_optimal_strategy(self, num_stages: int = None, *, current_split=None, model=None, cluster=None,
                                 global_batch_size: int = None, seq_len: int = None, current=None) -> Suggestion:
        """The pipeline split minimising the slowest stage of the measured per-layer times (balanced_split),
        and, given a planner model (preset or ModelSpec), ``global_batch_size`` and the ``current``
        configuration ("dp=2,tp=2,pp=2"), ``ap.plan`` re-run on a cluster whose device and link rates are
        scaled so that its prediction for the current configuration is the measured step time."""
        from autoparallel.parallel.pipeline.split import balanced_split

        layers = self.layer_times()
        if not layers:
            raise ValueError("no per-layer timings: record them with mon.record('layer', index=i)")
        split = [tuple(s) for s in current_split] if current_split is not None else self.split
        k = num_stages or (len(split) if split else self.num_stages)
        if k is None:
            raise ValueError("give num_stages (or a current split) to suggest a pipeline split")
        split = split or even_split(len(layers), k)
        if len(split) != k:
            raise ValueError(f"the current split has {len(split)} stages, num_stages is {k}")
        best = [tuple(s) for s in balanced_split(layers, k)]
        out = Suggestion(k, layers, split, best, [sum(layers[a:b]) for a, b in split],
                         [sum(layers[a:b]) for a, b in best])
        if self.layer_names is not None:
            if len(self.layer_names) != len(layers):
                raise ValueError(f"layer_names has {len(self.layer_names)} names for {len(layers)} timed layers")
            out.split_points = [self.layer_names[a] for a, _ in best[1:]]
        if model is not None:
            self._replan(out, model, cluster, global_batch_size, seq_len, current)
        return out

    def _replan(self, out: Suggestion, model, cluster, global_batch_size, seq_len, current) -> None:
        from dataclasses import replace

        from autoparallel.planner.api import plan
        from autoparallel.planner.cluster import default_cluster, parse_cluster

        if global_batch_size is None or current is None:
            raise ValueError("re-planning needs global_batch_size and the current configuration, e.g. "
                             "current='dp=2,tp=2,pp=2'")
        steps = [t["step"] for t in self._per_rank().values() if "step" in t]
        if not steps:
            raise ValueError("re-planning needs measured step times: record them with mon.record('step')")
        measured = max(steps)
        cluster = default_cluster() if cluster is None else parse_cluster(cluster)
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
        if out.plan.best is not None:
            out.strategy = out.plan.best.to_strategy_dict()
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
