"""Stage split: exact balanced contiguous partition (checked against brute force) and user split points."""
import itertools

import numpy as np
import pytest

from autoparallel.parallel.pipeline import balanced_split, split_at, stage_costs


def brute_force(costs, k, memory=None, limit=None):
    """Every contiguous split into k non-empty stages; the best (bottleneck, sum of squares), or None."""
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0,) + cuts + (n,)
        bounds = list(zip(edges[:-1], edges[1:]))
        if memory is not None and any(sum(memory[a:b]) > limit + 1e-9 for a, b in bounds):
            continue
        sc = stage_costs(costs, bounds)
        key = (max(sc), sum(c * c for c in sc))
        best = key if best is None or key < best else best
    return best


def _is_partition(bounds, n, k):
    assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a < b for a, b in bounds) and all(bounds[i][1] == bounds[i + 1][0] for i in range(k - 1))


def test_matches_brute_force_on_random_cases():
    rng = np.random.default_rng(0)
    for _ in range(150):
        n = int(rng.integers(1, 9))
        k = int(rng.integers(1, n + 1))
        costs = list(rng.choice([0.5, 1.0, 2.0, 3.0], size=n)) if rng.random() < 0.4 else list(rng.random(n) * 5)
        bounds = balanced_split(costs, k)
        _is_partition(bounds, n, k)
        sc = stage_costs(costs, bounds)
        want = brute_force(costs, k)
        assert max(sc) == pytest.approx(want[0]) and sum(c * c for c in sc) == pytest.approx(want[1])
        assert balanced_split(costs, k) == bounds                      # deterministic


def test_memory_limit_matches_brute_force():
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(150):
        n = int(rng.integers(2, 9))
        k = int(rng.integers(1, n + 1))
        costs, memory = list(rng.random(n) * 4), list(rng.random(n) * 3)
        limit = float(rng.uniform(max(memory), sum(memory)))
        want = brute_force(costs, k, memory, limit)
        if want is None:
            with pytest.raises(ValueError, match="memory_limit"):
                balanced_split(costs, k, memory, limit)
            continue
        bounds = balanced_split(costs, k, memory, limit)
        _is_partition(bounds, n, k)
        assert all(sum(memory[a:b]) <= limit + 1e-9 for a, b in bounds)
        assert max(stage_costs(costs, bounds)) == pytest.approx(want[0])
        checked += 1
    assert checked > 50


def test_examples():
    assert balanced_split([1] * 6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert balanced_split([1] * 5, 2) == [(0, 2), (2, 5)]                  # tie broken deterministically
    # a heavy embedding and head get stages of their own; the blocks share the middle ones
    costs = [4.0] + [1.0] * 8 + [4.0]
    assert balanced_split(costs, 4) == [(0, 1), (1, 5), (5, 9), (9, 10)]
    # [4, 5, 5] and [5, 4, 5] tie on bottleneck and sum of squares: the smaller stage ends win
    costs = [3.0] + [1.0] * 8 + [3.0]
    assert stage_costs(costs, balanced_split(costs, 3)) == [4.0, 5.0, 5.0]
    # a memory limit forces a worse-balanced but feasible split
    assert balanced_split([1, 1, 1, 5], 2, memory=[1, 1, 2, 1], memory_limit=3) == [(0, 2), (2, 4)]
    assert balanced_split([1, 1, 1, 5], 2) == [(0, 3), (3, 4)]


GPT_LAYERS = ["wte", "wpe"] + [f"blocks.{i}" for i in range(12)] + ["ln_f", "lm_head"]


def test_split_at_points():
    bounds = split_at(GPT_LAYERS, ["blocks.4", "blocks.8"])
    assert [GPT_LAYERS[a:b][0] for a, b in bounds] == ["wte", "blocks.4", "blocks.8"]
    assert [b - a for a, b in bounds] == [6, 4, 6]
    fine = ["wte"] + [f"blocks.{i}.{part}" for i in range(4) for part in ("attn.qkv", "mlp.fc2")] + ["lm_head"]
    assert split_at(fine, ["blocks.2"]) == [(0, 5), (5, 10)]              # prefix of sublayer names
    assert split_at(GPT_LAYERS, []) == [(0, len(GPT_LAYERS))]
    assert split_at(GPT_LAYERS, ["blocks.6"], num_stages=2) == [(0, 8), (8, 16)]


def test_split_errors():
    with pytest.raises(ValueError, match=r"'block.4' names no layer; nearby names: \['blocks.4'"):
        split_at(GPT_LAYERS, ["block.4"])
    with pytest.raises(ValueError, match="blocks.1' names no layer"):
        split_at(["wte", "blocks.10", "blocks.11"], ["blocks.1"])              # no false prefix match
    with pytest.raises(ValueError, match="more stages than layers"):
        split_at(["a", "b"], ["b", "c"])
    with pytest.raises(ValueError, match="increasing model order"):
        split_at(GPT_LAYERS, ["blocks.8", "blocks.4"])
    with pytest.raises(ValueError, match="increasing model order"):
        split_at(GPT_LAYERS, ["blocks.4", "blocks.4"])
    with pytest.raises(ValueError, match="stage 0 empty"):
        split_at(GPT_LAYERS, ["wte"])
    with pytest.raises(ValueError, match="num_stages=4"):
        split_at(GPT_LAYERS, ["blocks.4"], num_stages=4)
    with pytest.raises(ValueError, match="more stages than layers"):
        balanced_split([1.0, 2.0], 3)
    with pytest.raises(ValueError, match="positive int"):
        balanced_split([1.0, 2.0], 0)
    with pytest.raises(ValueError, match="non-negative"):
        balanced_split([1.0, -2.0], 1)
    with pytest.raises(ValueError, match="give both or neither"):
        balanced_split([1.0, 2.0], 1, memory=[1, 1])
    with pytest.raises(ValueError, match="one value per layer"):
        balanced_split([1.0, 2.0], 1, memory=[1], memory_limit=3)
    with pytest.raises(ValueError, match="largest single layer needs 5"):
        balanced_split([1.0, 2.0], 2, memory=[5, 1], memory_limit=3)
