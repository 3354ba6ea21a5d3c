"""Stage split: a model's ordered layers cut into contiguous pipeline stages.

``balanced_split`` minimises the slowest stage (exact dynamic programme over prefix sums), optionally
under a per-stage memory limit; among optimal splits it picks the one with the smallest sum of squared
stage costs (the most even), then the lexicographically smallest stage ends, so ties are deterministic.
``split_at`` cuts at user split points. Both return half-open index ranges ``[(start, stop), ...]``, one
per stage: stage k holds ``layers[start:stop]``.
"""
from __future__ import annotations

import difflib
from typing import Optional, Sequence

_REL_TOL = 1e-9


def _le(a: float, b: float) -> bool:
    return a <= b + _REL_TOL * max(1.0, abs(b))


def _check_values(name: str, values: Sequence[float]) -> list:
    out = [float(x) for x in values]
    if any(x < 0 or x != x for x in out):
        raise ValueError(f"{name} must be non-negative numbers, got {out}")
    return out


def _prefix(values: list) -> list:
    acc = [0.0]
    for x in values:
        acc.append(acc[-1] + x)
    return acc


def balanced_split(costs: Sequence[float], num_stages: int, memory: Optional[Sequence[float]] = None,
                   memory_limit: Optional[float] = None) -> list:
    """Contiguous split of per-layer ``costs`` into ``num_stages`` non-empty stages minimising the largest
    stage cost; with ``memory`` (per layer) and ``memory_limit``, every stage's memory stays within it."""
    costs = _check_values("costs", costs)
    n = len(costs)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if num_stages > n:
        raise ValueError(f"cannot split {n} layers into {num_stages} non-empty stages: more stages than layers")
    if (memory is None) != (memory_limit is None):
        raise ValueError("memory and memory_limit go together: give both or neither")
    mem = _check_values("memory", memory) if memory is not None else [0.0] * n
    if len(mem) != n:
        raise ValueError(f"memory needs one value per layer ({n}), got {len(mem)}")
    limit = float("inf") if memory_limit is None else float(memory_limit)
    pc, pm = _prefix(costs), _prefix(mem)

    def fits(i: int, j: int) -> bool:
        return _le(pm[j] - pm[i], limit)

    # best[k][j]: (bottleneck, sum of squares, stage ends) for layers[:j] in k stages
    inf = (float("inf"), float("inf"), ())
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0, ())
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            cand = inf
            for i in range(k - 1, j):
                prev = best[k - 1][i]
                if prev[0] == float("inf") or not fits(i, j):
                    continue
                c = pc[j] - pc[i]
                key = (max(prev[0], c), prev[1] + c * c, prev[2] + (j,))
                if _better(key, cand):
                    cand = key
            best[k][j] = cand
    result = best[num_stages][n]
    if result[0] == float("inf"):
        raise ValueError(f"no contiguous split of {n} layers into {num_stages} stages keeps every stage within "
                         f"memory_limit={memory_limit} (largest single layer needs {max(mem)}, total {pm[-1]})")
    ends = result[2]
    return list(zip((0,) + ends[:-1], ends))


def _better(a: tuple, b: tuple) -> bool:
    """Order on (bottleneck, sum of squares, ends) with a relative tolerance on the float parts."""
    for x, y in ((a[0], b[0]), (a[1], b[1])):
        if not _le(x, y):
            return False
        if not _le(y, x):
            return True
    return a[2] < b[2]


def stage_costs(costs: Sequence[float], bounds: Sequence[tuple]) -> list:
    """Total cost of each stage of a split."""
    return [float(sum(costs[a:b])) for a, b in bounds]


def split_at(names: Sequence[str], split_points: Sequence[str], num_stages: Optional[int] = None) -> list:
    """Split ordered layer ``names`` before each split point: ``["blocks.4", "blocks.8"]`` gives three stages,
    the second starting at the first name equal to ``blocks.4`` or below it (``blocks.4.attn.qkv``)."""
    names = list(names)
    points = list(split_points)
    if num_stages is not None and num_stages != len(points) + 1:
        raise ValueError(f"{len(points)} split points make {len(points) + 1} stages, but num_stages={num_stages}")
    if len(points) + 1 > len(names):
        raise ValueError(f"cannot split {len(names)} layers into {len(points) + 1} stages: more stages than layers")
    starts = []
    for point in points:
        idx = next((i for i, name in enumerate(names) if name == point or name.startswith(point + ".")), None)
        if idx is None:
            near = difflib.get_close_matches(point, names, n=5, cutoff=0.5) or names[:5]
            raise ValueError(f"split point {point!r} names no layer; nearby names: {near}")
        if idx == 0:
            raise ValueError(f"split point {point!r} is the first layer, which would leave stage 0 empty")
        if starts and idx <= starts[-1]:
            raise ValueError(f"split points must name layers in increasing model order without repeats; "
                             f"{point!r} (layer #{idx}) comes after layer #{starts[-1]}")
        starts.append(idx)
    edges = [0] + starts + [len(names)]
    return list(zip(edges[:-1], edges[1:]))
