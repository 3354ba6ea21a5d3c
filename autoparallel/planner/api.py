"""``ap.plan``: choose (or evaluate) a parallel configuration for a model on a cluster."""
from __future__ import annotations

import time
from dataclasses import replace

from autoparallel.config.fields import integral
from autoparallel.core.cluster import ClusterSpec, default_cluster, parse_cluster
from autoparallel.planner import dualpipe
from autoparallel.planner.config import config_from_fixed, parse_fixed
from autoparallel.planner.explain import (explain_fixed, explain_search, fixed_suggestions, infeasible_message,
                                          search_suggestions)
from autoparallel.planner.model_spec import parse_model
from autoparallel.planner.options import PlannerOptions, options_for_cluster
from autoparallel.planner.result import PlanResult
from autoparallel.planner.search import (SearchSpace, candidate_at, divisors, evaluate_config, invalid_reason,
                                         search, tp_divides_model)


def _positive_int(name, value):
    number = integral(value)                  # numpy ints as ints; bools and floats refused
    if number is None or number <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return number


def _cluster_for_world(cluster: ClusterSpec, world: int) -> ClusterSpec:
    """The part of ``cluster`` a fixed configuration of ``world`` devices runs on (whole nodes, or one node)."""
    if world == cluster.world_size:
        return cluster
    if world > cluster.world_size:
        raise ValueError(f"dp·tp·pp = {world} devices, but the cluster {cluster.name} has {cluster.world_size}")
    if world % cluster.devices_per_node == 0:
        return cluster.with_nodes(world // cluster.devices_per_node)
    if world < cluster.devices_per_node:
        topology = cluster.topology and replace(cluster.topology, gpus_per_node=0)    # part of one node
        return replace(cluster, num_nodes=1, devices_per_node=world, topology=topology)
    raise ValueError(f"dp·tp·pp = {world} devices is neither the whole cluster ({cluster.world_size}), whole nodes "
                     f"of {cluster.devices_per_node}, nor part of one node")


def _model_spec(model_or_preset, seq_len):
    """A ModelSpec of a preset, dimension string or ModelSpec, or of a paddle model by its op trace (its
    config where the trace cannot follow it: planner/model_read.py)."""
    if hasattr(model_or_preset, "named_sublayers"):
        from autoparallel.planner.auto import infer_seq_len
        from autoparallel.planner.model_read import read_model

        seq = infer_seq_len(model_or_preset, seq_len)
        return read_model(model_or_preset, seq, type(model_or_preset).__name__)
    return parse_model(model_or_preset)


def _empty_space_error(model, cluster, global_batch, space) -> ValueError:
    world = cluster.world_size
    tps = [t for t in divisors(world) if tp_divides_model(model, t) and space.allows("tp", t)]
    dps = sorted({world // (t * p) for t in tps for p in divisors(world // t) if p <= model.layers
                  and space.allows("pp", p)})
    constrained = space.constrained()
    extra = f" under the constraints {constrained}" if constrained else ""
    return ValueError(f"no valid configuration of {model.name} on {world} devices with global batch {global_batch}"
                      f"{extra}: the data-parallel degree must divide the global batch, and the possible degrees "
                      f"(tp dividing the heads, pp <= {model.layers} layers) are dp in {dps}")


def plan(model_or_preset, cluster=None, global_batch_size=None, seq_len=None, top=5, fixed=None, options=None,
         **constraints) -> PlanResult:
    """Rank parallel configurations of a model on a cluster by predicted step time.

    model_or_preset: a preset name ("llama2-70b"), "hidden=..,layers=..,heads=..,vocab=..", a ModelSpec, or a
    paddle model (traced with ``ModelSpec.from_trace``; seq_len defaults to its config's).
    cluster: "128x8:A100-80GB", a calibrated profile .json, a ClusterSpec, or None (nodes of 8 A100-80GB).
    global_batch_size: sequences per optimizer step. seq_len: tokens per sequence (default: the model's).
    top: candidates to return. fixed: "dp=4,tp=8,..." or a dict — evaluate that one configuration
    (omitted keys take defaults) and compare it with the search's best. options: PlannerOptions.
    constraints: allowed values per knob, e.g. ``tp=[4, 8], recompute="full", offload=[0]``.

    Raises ValueError on bad input; an infeasible request returns a PlanResult with ``feasible=False``
    and an explanation naming the smallest change that fits.
    """
    start = time.perf_counter()
    model = _model_spec(model_or_preset, seq_len)
    cluster = default_cluster() if cluster is None else parse_cluster(cluster)
    global_batch = _positive_int("global_batch_size", global_batch_size)
    seq = model.seq_len if seq_len is None else _positive_int("seq_len", seq_len)
    top = _positive_int("top", top)
    options = options_for_cluster(cluster, options)
    if not isinstance(options, PlannerOptions):
        raise TypeError(f"options must be a PlannerOptions, got {type(options).__name__}")
    space = SearchSpace.from_constraints(constraints)
    capacity = cluster.device.memory_bytes
    if fixed is not None:
        return _plan_fixed(model, cluster, global_batch, seq, fixed, options, space, start)

    outcome = search(model, cluster, global_batch, seq, space, options)
    if outcome.evaluated == 0:
        raise _empty_space_error(model, cluster, global_batch, space)
    candidates = outcome.top(top, global_batch, seq, capacity)
    if candidates:
        explanation = _planner_only_note(options, candidates) + explain_search(outcome, candidates, global_batch, seq,
                                                                               capacity)
        return PlanResult(model, cluster, global_batch, seq, candidates, explanation, True, outcome.evaluated,
                          time.perf_counter() - start)
    closest = candidate_at(outcome.evaluation, outcome.grid, outcome.least_memory(), global_batch, seq, capacity)
    suggestions = search_suggestions(model, cluster, global_batch, seq, space, options)
    headline = (f"No configuration of {model.name} (global batch {global_batch}, seq {seq}) on {cluster.name} fits "
                f"in {capacity / 1e9:.1f} GB per device.")
    message = infeasible_message(headline, closest, suggestions)
    return PlanResult(model, cluster, global_batch, seq, [], message, False, outcome.evaluated,
                      time.perf_counter() - start, suggestions=suggestions)


def _planner_only_note(options, candidates=(), fixed=False) -> str:
    """What of the plan the runtime cannot run: an fp8 precision, the DualPipe schedule of a listed candidate (of
    the ``fixed`` configuration)."""
    note = ""
    if options.planner_only:
        core = "" if options.core_dtype == options.compute_dtype else (
            f" (the linear layers; the attention core, output head and router at its {options.core_dtype} peak)")
        note += (f"Note: precision {options.precision} is priced at the device's {options.compute_dtype} peak{core} "
                 f"but is planner-only: the runtime cannot run it (its AMP offers float16 and bfloat16).\n")
    ranks = [str(i + 1) for i, c in enumerate(candidates) if c.config.dualpipe]
    if ranks:
        who = "the configuration" if fixed else f"candidate {', '.join(ranks)}"
        note += (f"Note: {who} uses the {dualpipe.NAME} schedule ({dualpipe.SOURCE}), priced "
                 f"but planner-only: the runtime runs 1F1B or VPP, and applying the plan raises "
                 f"NotImplementedError.\n")
    return note


def _plan_fixed(model, cluster, global_batch, seq, fixed, options, space, start) -> PlanResult:
    values = parse_fixed(fixed)
    tp, pp = values.get("tp", 1), values.get("pp", 1)
    if "dp" in values:
        world = values["dp"] * tp * pp
    else:
        if cluster.world_size % (tp * pp):
            raise ValueError(f"tp·pp = {tp}·{pp} = {tp * pp} does not divide the {cluster.world_size} devices of "
                             f"{cluster.name}")
        world = cluster.world_size
    sub = _cluster_for_world(cluster, world)
    config = config_from_fixed(values, sub.world_size)
    reason = invalid_reason(model, sub.world_size, global_batch, seq, config, options)
    if reason is not None:
        raise ValueError(f"invalid fixed configuration ({config.short()}): {reason}")
    cand = evaluate_config(model, sub, global_batch, seq, config, options)
    outcome = search(model, sub, global_batch, seq, space, options)
    reference = None
    if len(outcome.order):
        reference = candidate_at(outcome.evaluation, outcome.grid, int(outcome.order[0]), global_batch, seq,
                                 sub.device.memory_bytes)
    note = "" if sub is cluster else (f"(runs on {sub.world_size} of the {cluster.world_size} devices of "
                                      f"{cluster.name})\n")
    suggestions = []
    if cand.feasible:
        explanation = _planner_only_note(options, [cand], fixed=True) + note + explain_fixed(cand, reference)
    else:
        suggestions = fixed_suggestions(model, sub, global_batch, seq, config, options)
        if reference is not None:
            suggestions.append({"change": f"use the planner's best configuration ({reference.config.short()})",
                                "config": reference.config.to_dict(), "step_time_s": reference.step_time_s,
                                "memory_per_device_gb": reference.memory_per_device_gb})
        headline = (f"{note}The fixed configuration {config.short()} of {model.name} on {sub.name} needs "
                    f"{cand.memory_per_device_gb:.1f} GB per device, more than the {sub.device.memory_bytes / 1e9:.1f} GB "
                    f"it has.")
        explanation = _planner_only_note(options, [cand], fixed=True) + infeasible_message(
            headline, cand, suggestions, closest_label="breakdown")
    return PlanResult(model, sub, global_batch, seq, [cand], explanation, cand.feasible, 1 + outcome.evaluated,
                      time.perf_counter() - start, mode="fixed", reference=reference, suggestions=suggestions)
