"""Search pruning: configurations ruled out by a memory floor cannot fit, and pruning changes no ranking."""
import numpy as np
import pytest

from autoparallel.planner import published
from autoparallel.planner.cluster import parse_cluster
from autoparallel.planner.cost_model import evaluate
from autoparallel.planner.model_spec import PRESETS, parse_model
from autoparallel.planner.options import PlannerOptions
from autoparallel.planner.search import (SearchSpace, _fits, _knob_rows, build_grid, expand_grid, search,
                                         structural_grid)


def _ranked(outcome):
    keys = tuple(outcome.grid)
    return [tuple(int(outcome.grid[k][i]) for k in keys) + (float(outcome.evaluation["step_time_s"][i]),)
            for i in outcome.order]


@pytest.mark.parametrize("run", published.RUNS, ids=[r.name for r in published.RUNS])
def test_pruning_keeps_every_feasible_plan_in_the_same_order(run):
    """Published dense jobs: the same feasible configurations, same step times, same order, with and without
    pruning; the pruned ones plus the priced ones are the whole space."""
    model, cluster, options = PRESETS[run.model], published.run_cluster(run), run.options()
    full = search(model, cluster, run.global_batch, run.seq_len, SearchSpace(), options, prune=False)
    fast = search(model, cluster, run.global_batch, run.seq_len, SearchSpace(), options)
    assert _ranked(fast) == _ranked(full)
    assert fast.evaluated + fast.ruled_out == full.evaluated
    assert fast.ruled_out > 0 or run.gpus <= 8


@pytest.mark.parametrize("model,cluster,batch,seq,opts", [
    ("mixtral-8x7b", "4x8:H100-80GB", 256, 4096, PlannerOptions()),
    ("llama2-70b", "8x8:A100-80GB", 512, 4096, PlannerOptions(flash_attention=True)),
    ("gpt3-1.3b", "1x8:A100-40GB", 64, 2048, PlannerOptions(zero_grad_per_micro_batch=True)),
])
def test_memory_floor_never_exceeds_the_priced_memory(model, cluster, batch, seq, opts):
    """Every configuration the floor rules out is priced above the device's memory (so it is infeasible), and
    the floor rules some out (the check could fail)."""
    model, cluster, space = PRESETS.get(model) or parse_model(model), parse_cluster(cluster), SearchSpace()
    struct = structural_grid(model, cluster.world_size, batch, seq, space, opts)
    fits = _fits(model, cluster, batch, seq, struct, space, opts)
    grid, _ = expand_grid(struct, seq, space)
    ruled, left_out = expand_grid(struct, seq, space, ~fits)
    assert left_out == len(grid["dp"]) - len(ruled["dp"]) and len(ruled["dp"]) > 0
    ev = evaluate(model, cluster, batch, seq, ruled, opts)
    assert (ev["memory_total"] > cluster.device.memory_bytes).all()


def test_nothing_fits_reports_the_least_memory_configuration_of_the_whole_space():
    model, cluster, options = PRESETS["llama2-70b"], parse_cluster("1x8:A100-40GB"), PlannerOptions()
    full = search(model, cluster, 64, 4096, SearchSpace(), options, prune=False)
    fast = search(model, cluster, 64, 4096, SearchSpace(), options)
    assert len(full.order) == 0 and len(fast.order) == 0
    assert fast.evaluated == full.evaluated and fast.ruled_out == 0
    assert fast.least_memory() == full.least_memory()


def test_build_grid_is_the_unpruned_space():
    model, cluster = PRESETS["mixtral-8x7b"], parse_cluster("4x8:H100-80GB")
    grid = build_grid(model, cluster.world_size, 256, 4096, SearchSpace(), PlannerOptions())
    out = search(model, cluster, 256, 4096, SearchSpace(), PlannerOptions())
    assert len(grid["dp"]) == out.evaluated + out.ruled_out and out.ruled_out > 0
    assert len(_knob_rows(SearchSpace())) == 2 * 4 * 3 * 2


def test_explanation_counts_the_ruled_out_configurations():
    import re

    import autoparallel as ap

    model, cluster, space = PRESETS["llama2-70b"], parse_cluster("8x8:A100-80GB"), SearchSpace()
    result = ap.plan("llama2-70b", "8x8:A100-80GB", global_batch_size=512, seq_len=4096)
    out = search(model, cluster, 512, 4096, space, PlannerOptions())
    valid = len(build_grid(model, cluster.world_size, 512, 4096, space, PlannerOptions())["dp"])
    infeasible = int(np.count_nonzero(~out.evaluation["feasible"])) + out.ruled_out
    match = re.search(r"(\d+) of (\d+) configurations exceed .*\((\d+) ruled out unpriced", result.explanation)
    assert match, result.explanation
    assert [int(x) for x in match.groups()] == [infeasible, valid, out.ruled_out]
    assert result.evaluated == out.evaluated == valid - out.ruled_out
