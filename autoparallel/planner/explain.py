"""Explanations: why the winner beats the alternatives, and what would make an infeasible request fit."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from autoparallel.planner.config import ParallelConfig
from autoparallel.planner.search import config_at, candidate_at, evaluate_config, invalid_reason, search

TERM_NAMES = {"compute": "compute", "recompute": "recomputation", "tp_comm": "TP communication",
              "zero3_gather": "exposed ZeRO-3 gathers", "bubble": "pipeline bubble",
              "pp_comm": "stage-to-stage sends", "dp_comm": "exposed DP gradient sync", "optimizer": "optimizer step",
              "overhead": "per-op overheads", "ep_comm": "expert all-to-all"}
KNOB_LABELS = (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("vpp", "vpp"), ("sp", "sp"), ("sharding", "zero"),
               ("recompute", "recompute"), ("offload", "offload"), ("micro_batch", "micro_batch"), ("ep", "ep"),
               ("split", "split"), ("dualpipe", "dualpipe"))
_GRID_OF_KNOB = {"tp": "tp", "pp": "pp", "dp": "dp", "vpp": "vpp", "sp": "sp", "sharding": "zero",
                 "recompute": "recompute", "offload": "offload", "micro_batch": "mb", "ep": "ep", "split": "split",
                 "dualpipe": "dualpipe"}


def config_diff(a: ParallelConfig, b: ParallelConfig) -> str:
    """'tp=8 instead of 4, recompute=full instead of selective'."""
    parts = [f"{label}={getattr(b, k)} instead of {getattr(a, k)}" for k, label in KNOB_LABELS
             if getattr(a, k) != getattr(b, k)]
    return ", ".join(parts) if parts else "the same configuration"


def dominant_terms(winner, other, count=2) -> str:
    """The time terms that differ most between two candidates, largest first: 'TP communication +0.41 s'."""
    deltas = sorted(((other.time_s[k] - winner.time_s[k], k) for k in winner.time_s),
                    key=lambda x: (-abs(x[0]), x[1]))
    shown = [f"{TERM_NAMES[k]} {d:+.3f} s" for d, k in deltas[:count] if abs(d) > 1e-9]
    return ", ".join(shown) if shown else "no term differs"


def describe(c, label="") -> str:
    total = c.step_time_s
    terms = ", ".join(f"{TERM_NAMES[k]} {v:.3f} s" for k, v in c.time_s.items() if v > 1e-9 * max(total, 1e-30))
    mem = ", ".join(f"{k} {v:.1f}" for k, v in c.memory_gb.items() if v > 0.005)
    sched = "no pipeline" if c.config.pp == 1 else f"{c.config.schedule} schedule"
    head = f"{label}{c.config.short()} ({sched}, {c.num_micro_batches} micro-batch{'es' if c.num_micro_batches != 1 else ''})"
    return (f"{head}\n  step {total:.3f} s = {terms}\n  {c.tokens_per_s:,.0f} tokens/s, "
            f"{c.tflops_per_device:.4g} TFLOP/s per device, MFU {100 * c.mfu:.1f}%\n"
            f"  memory {c.memory_per_device_gb:.1f} of {c.capacity_gb:.1f} GB per device ({mem})")


def compare(winner, other, label) -> str:
    slower = other.step_time_s / winner.step_time_s - 1.0
    return (f"  {label} ({config_diff(winner.config, other.config)}): {other.step_time_s:.3f} s, "
            f"{100 * slower:+.1f}%: {dominant_terms(winner, other)}; {other.memory_per_device_gb:.1f} GB")


def explain_search(outcome, candidates, global_batch, seq_len, capacity) -> str:
    """Why #1 wins: for each knob, the best feasible plan that sets it differently, and what costs it more."""
    if not candidates:
        return ""
    winner = candidates[0]
    lines = [describe(winner, "#1 "), "Why #1: the best plan that changes each knob, and the cost terms that grow:"]
    order, grid = outcome.order, outcome.grid
    seen = set()
    for knob, label in KNOB_LABELS:
        values = grid[_GRID_OF_KNOB[knob]][order]
        mine = getattr(winner.config, knob)
        if knob == "recompute":
            mine = ("none", "selective", "full").index(mine)
        if knob == "split":
            mine = ("even", "ends", "balanced").index(mine)
        differs = np.nonzero(values != mine)[0]
        if len(differs) == 0:
            continue
        index = int(order[differs[0]])
        if index in seen:
            continue
        seen.add(index)
        other = candidate_at(outcome.evaluation, grid, index, global_batch, seq_len, capacity)
        lines.append(compare(winner, other, f"best with another {label}"))
    ev = outcome.evaluation
    infeasible = int(np.count_nonzero(~ev["feasible"]))
    ruled_out = getattr(outcome, "ruled_out", 0)
    if infeasible or ruled_out:
        faster = np.nonzero((~ev["feasible"]) & (ev["step_time_s"] < winner.step_time_s))[0]
        note = (f"  {infeasible + ruled_out} of {outcome.evaluated + ruled_out} configurations exceed "
                f"{capacity / 1e9:.0f} GB per device (or, offloading, the host RAM)")
        if ruled_out:
            note += f" ({ruled_out} ruled out unpriced by their memory floor)"
        if len(faster):
            i = int(faster[np.lexsort((ev["memory_total"][faster], ev["step_time_s"][faster]))[0]])
            fast = candidate_at(ev, grid, i, global_batch, seq_len, capacity)
            note += (f"; the fastest of those priced ({config_diff(winner.config, fast.config)}) would take "
                     f"{fast.step_time_s:.3f} s but needs {fast.memory_per_device_gb:.1f} GB")
        lines.append(note)
    return "\n".join(lines)


def explain_fixed(candidate, reference) -> str:
    text = describe(candidate, "Fixed configuration: ")
    if reference is None:
        return text + "\n  no configuration of the search space fits, so there is nothing to compare with"
    if reference.config == candidate.config:
        return text + "\n  this is also the planner's best configuration"
    slower = candidate.step_time_s / reference.step_time_s - 1.0
    return (text + f"\n  the planner's best, {reference.config.short()}, takes {reference.step_time_s:.3f} s: the fixed "
            f"configuration is {100 * slower:+.1f}% ({dominant_terms(reference, candidate)})")


# ---------------------------------------------------------------------------------------------
# infeasibility: the smallest change that fits
# ---------------------------------------------------------------------------------------------
def _single_changes(config: ParallelConfig):
    """Single-knob changes of a configuration, smallest first: (description, field updates)."""
    c = config
    out = []
    mb = c.micro_batch // 2
    while mb >= 1:
        out.append((f"micro_batch={mb}", {"micro_batch": mb}))
        mb //= 2
    levels = ("none", "selective", "full")
    for rc in levels[levels.index(c.recompute) + 1:]:
        out.append((f"recompute={rc}", {"recompute": rc}))
    if not c.sp and c.tp > 1:
        out.append(("sp=1", {"sp": 1}))
    for z in range(c.sharding + 1, 4):
        out.append((f"sharding={z}", {"sharding": z}))
    if not c.offload:
        out.append(("offload=1", {"offload": 1, "sharding": max(c.sharding, 1)}))
    if c.dp % 2 == 0:
        out.append((f"tp={2 * c.tp}, dp={c.dp // 2}", {"tp": 2 * c.tp, "dp": c.dp // 2}))
        out.append((f"pp={2 * c.pp}, dp={c.dp // 2}", {"pp": 2 * c.pp, "dp": c.dp // 2, "vpp": 1}))
    return out


def _change_sets(config: ParallelConfig):
    """Single changes, then pairs of changes to different knobs, in order of size."""
    singles = _single_changes(config)
    yield from singles
    for i, (text_a, a) in enumerate(singles):
        for text_b, b in singles[i + 1:]:
            if set(a) & set(b):
                continue
            yield f"{text_a} and {text_b}", {**a, **b}


def fixed_suggestions(model, cluster, global_batch, seq_len, config, options, limit=4) -> list:
    """Feasible changes of an infeasible ``config`` (one knob, else two), smallest change first."""
    found = []
    world = cluster.world_size
    size_of_first = None
    for text, updates in _change_sets(config):
        changed = replace(config, **updates)
        if invalid_reason(model, world, global_batch, seq_len, changed, options) is not None:
            continue
        size = text.count(" and ") + 1
        if size_of_first is not None and size > size_of_first:
            break
        cand = evaluate_config(model, cluster, global_batch, seq_len, changed, options)
        if cand.feasible:
            size_of_first = size
            found.append({"change": text, "config": changed.to_dict(), "step_time_s": cand.step_time_s,
                          "memory_per_device_gb": cand.memory_per_device_gb})
            if len(found) >= limit:
                break
    return found


def _more_devices(model, cluster, global_batch, seq_len, space, options, max_factor=64):
    """The smallest node count (up to max_factor times more) whose search has a feasible configuration."""
    for factor in range(2, max_factor + 1):
        bigger = cluster.with_nodes(cluster.num_nodes * factor)
        out = search(model, bigger, global_batch, seq_len, space, options)
        if len(out.order):
            best = candidate_at(out.evaluation, out.grid, int(out.order[0]), global_batch, seq_len,
                                bigger.device.memory_bytes)
            return bigger, best
    return None, None


def search_suggestions(model, cluster, global_batch, seq_len, space, options) -> list:
    """Smallest changes that make a search with no feasible configuration succeed, smallest first."""
    from autoparallel.core.cluster import DEVICES
    found = []
    for key, allowed in space.constrained().items():       # 1. lift one constraint
        relaxed = replace(space, **{key: getattr(type(space)(), key)})
        out = search(model, cluster, global_batch, seq_len, relaxed, options)
        if len(out.order):
            best = config_at(out.grid, int(out.order[0]))
            found.append({"change": f"allow any {key} (not only {list(allowed)})", "config": best.to_dict(),
                          "step_time_s": float(out.evaluation["step_time_s"][out.order[0]]),
                          "memory_per_device_gb": float(out.evaluation["memory_total"][out.order[0]]) / 1e9})
    bigger, best = _more_devices(model, cluster, global_batch, seq_len, space, options)   # 2. more devices
    if bigger is not None:
        found.append({"change": f"use {bigger.num_nodes} nodes ({bigger.world_size} devices) instead of "
                                f"{cluster.num_nodes} ({cluster.world_size})", "config": best.config.to_dict(),
                      "step_time_s": best.step_time_s, "memory_per_device_gb": best.memory_per_device_gb})
    for name, device in sorted(DEVICES.items(), key=lambda kv: kv[1].memory_bytes):   # 3. bigger devices
        if device.memory_bytes <= cluster.device.memory_bytes:
            continue
        other = replace(cluster, device=device, name=f"{cluster.num_nodes}x{cluster.devices_per_node}:{name}")
        out = search(model, other, global_batch, seq_len, space, options)
        if len(out.order):
            best = config_at(out.grid, int(out.order[0]))
            found.append({"change": f"use {name} devices ({device.memory_bytes / 1e9:.0f} GB)",
                          "config": best.to_dict(),
                          "step_time_s": float(out.evaluation["step_time_s"][out.order[0]]),
                          "memory_per_device_gb": float(out.evaluation["memory_total"][out.order[0]]) / 1e9})
            break
    return found


def infeasible_message(headline: str, closest, suggestions, closest_label: str = "closest") -> str:
    """The headline, the configuration closest to fitting, and the smallest changes that fit."""
    lines = [headline]
    if closest is not None:
        lines.append(f"  {closest_label}: {closest.config.short()} needs {closest.memory_per_device_gb:.1f} GB ("
                     + ", ".join(f"{k} {v:.1f}" for k, v in closest.memory_gb.items() if v > 0.005) + ")")
    if suggestions:
        first = suggestions[0]
        lines.append(f"  smallest change that fits: {first['change']} -> {first['memory_per_device_gb']:.1f} GB, "
                     f"{first['step_time_s']:.3f} s per step")
        for other in suggestions[1:]:
            lines.append(f"  also fits: {other['change']} -> {other['memory_per_device_gb']:.1f} GB, "
                         f"{other['step_time_s']:.3f} s per step")
    else:
        lines.append("  no change tried (recompute, offload, ZeRO, sequence parallelism, smaller micro-batch, more "
                     "tp or pp, more devices up to 64x, larger-memory devices) makes it fit; shorten the sequence "
                     "or the model")
    return "\n".join(lines)
