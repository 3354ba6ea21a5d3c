"""Keep a rank's part of a parameter while its initial values stream past in chunks.

A ``Target`` is the part one rank keeps: a box of the global tensor (its local shard, one index range per
dim) and optionally a range of that box's row-major flat order (its ZeRO-3 chunk). The values of the
whole parameter are drawn chunk by chunk in flat order from one generator stream; each chunk is cut to
the positions the targets keep and then dropped, so the largest tensor alive is one chunk plus the kept
parts. Chunks have even length (all but the last): the CPU gaussian kernel draws values in pairs
(``std::normal_distribution``) and drops the spare one at the end of a call, so only even chunks continue
the stream exactly as one call over the whole tensor would. Uniform and truncated-normal draws use one
engine value per element, so any chunking works for them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import paddle


@dataclass
class Target:
    box: tuple                    # ((lo, hi), ...) per dim of the global shape
    flat: tuple | None = None     # (start, stop) in the box's flat order, or None for the whole box
    zeros: bool = False           # keeps zeros (Partial(sum) off coordinate 0), draws nothing
    kept: int = field(init=False, default=0)

    def __post_init__(self):
        box_numel = math.prod(hi - lo for lo, hi in self.box)
        if self.flat is None:
            self.count = box_numel
        else:
            a, b = self.flat
            self.count = max(0, min(b, box_numel) - a)

    def covers(self, shape) -> bool:
        return self.flat is None and all(lo == 0 and hi == n for (lo, hi), n in zip(self.box, shape))


def chunk_length(numel: int, targets, limit: int) -> int:
    """Even chunk length: at most ``limit`` and at most the largest part a target keeps (half the tensor
    when none keeps anything), so a chunk is never a full copy of a parameter this process does not own."""
    keep = max((t.count for t in targets if not t.zeros), default=0)
    n = keep if 0 < keep < numel else max(1, numel // 2) if keep == 0 else numel
    n = min(n, limit)
    return max(2, n - n % 2)


def box_positions(shape, box, s: int, e: int) -> np.ndarray:
    """Positions (relative to ``s``, increasing) of the box's elements among flat indices [s, e)."""
    if not shape:
        shape, box = (1,), ((0, 1),)
    width = shape[-1]
    lo, hi = box[-1]
    if hi <= lo or e <= s:
        return np.zeros([0], dtype=np.int64)
    rows = np.arange(s // width, (e - 1) // width + 1, dtype=np.int64)
    if len(shape) > 1:
        idx = np.unravel_index(rows, shape[:-1])
        keep = np.ones(len(rows), dtype=bool)
        for d, (a, b) in enumerate(box[:-1]):
            keep &= (idx[d] >= a) & (idx[d] < b)
        rows = rows[keep]
    pos = ((rows * width + lo)[:, None] + np.arange(hi - lo, dtype=np.int64)[None, :]).reshape([-1])
    return pos[(pos >= s) & (pos < e)] - s


def _take(values, pos: np.ndarray):
    if pos[-1] - pos[0] + 1 == len(pos):
        return values[int(pos[0]):int(pos[-1]) + 1]
    return paddle.gather(values, paddle.to_tensor(pos))


class Stats:
    """Sizes (elements) this process allocated while streaming one parameter."""

    def __init__(self):
        self.chunk = 0
        self.draws = 0
        self.drawn = 0

    def saw(self, n: int) -> None:
        self.chunk, self.draws, self.drawn = max(self.chunk, n), self.draws + 1, self.drawn + n


def stream(values_fn, shape, targets, limit: int, dtype, stats: Stats) -> list:
    """Draw the whole parameter through ``values_fn(n)`` in chunks; returns each target's kept values
    (1-d, in the box's flat order restricted to its flat range)."""
    numel = math.prod(shape)
    if targets and all(t.covers(shape) and not t.zeros for t in targets):
        v = values_fn(numel)                                  # every target keeps everything: one draw
        stats.saw(numel)
        return [v if i == 0 else v.clone() for i, _ in enumerate(targets)]
    outs = [paddle.zeros([t.count], dtype=dtype) if t.zeros else paddle.empty([t.count], dtype=dtype)
            for t in targets]
    seen = [0] * len(targets)
    step = chunk_length(numel, targets, limit)
    for s in range(0, numel, step):
        e = min(numel, s + step)
        v = values_fn(e - s)
        stats.saw(e - s)
        for i, t in enumerate(targets):
            if t.zeros or t.kept == t.count:
                continue
            pos = box_positions(shape, t.box, s, e)
            if t.flat is not None:
                a, b = t.flat
                pos, seen[i] = pos[max(0, a - seen[i]):max(0, b - seen[i])], seen[i] + len(pos)
            if len(pos):
                outs[i][t.kept:t.kept + len(pos)] = _take(v, pos)
                t.kept += len(pos)
        del v
    return outs
