"""Suggestions from what was measured: a balanced pipeline split of the per-layer times, or the planner
re-run on a cluster rescaled to the measured step time; both become a checked ``Strategy``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from autoparallel.monitoring.world import _world_size


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


class SuggestingMixin:
    """The suggestion methods of ``PerformanceMonitor`` (it supplies the measurements)."""

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
