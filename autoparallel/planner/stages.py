"""Pipeline stage splits: how many blocks each of the p stages holds.

    even      as equal as possible; the surplus blocks go to the middle stages first
    ends      the first and the last stage hold one block fewer than the middle ones (room for the embedding
              and for the output head; LLaMA 3 405B's 126 blocks on 16 stages: 7, 8 x 14, 7)
    balanced  the output head priced as ``head_eq`` blocks, the embedding as ``embedding_eq`` blocks, and the
              split that minimises the slowest stage's load (ties: the lighter last stage)

With v virtual stages (interleaving) a stage's blocks are spread over its v chunks, so every stage needs at
least v blocks (under ``ends`` the first and the last stage v - 1: their end chunk holds the embedding or the head,
as in LLaMA 3's schedule); layers need not divide by p·v. A split that leaves a stage (or a chunk) without a block is
invalid (``split_problem`` says why).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from autoparallel.planner.config import SPLITS
from autoparallel.planner.dualpipe import pair_blocks, rank_loads


def _even(layers, p):
    base, extra = divmod(layers, p)
    counts = [base] * p
    order = list(range(1, p - 1)) + [0, p - 1]          # middle stages first, then first, then last
    for i in order[:extra]:
        counts[i] += 1
    return counts


def _ends(layers, p):
    if p <= 2:
        return _even(layers, p)
    edge = (layers + 2) // p - 1
    rest = _even(layers - 2 * edge, p - 2)
    return [edge] + rest + [edge]


def _balanced(layers, p, head_eq, embedding_eq):
    if p == 1:
        return [layers]

    def capacity(x):
        first, last = math.floor(x - embedding_eq + 1e-9), math.floor(x - head_eq + 1e-9)
        return first, last, (p - 2) * math.floor(x + 1e-9)

    candidates = sorted({n + off for n in range(0, layers + 1) for off in (0.0, embedding_eq, head_eq)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:                                      # smallest load X whose stages can hold every block
        mid = (lo + hi) // 2
        f, l_, m = capacity(candidates[mid])
        if max(f, 0) + max(l_, 0) + m >= layers:
            hi = mid
        else:
            lo = mid + 1
    f, l_, m = capacity(candidates[lo])
    last = max(1, min(l_, layers - (p - 1)))
    first = max(1, min(f, layers - last - (p - 2)))
    middle = _even(layers - first - last, p - 2) if p > 2 else []
    if p == 2:
        first = layers - last
    return [first] + middle + [last]


@lru_cache(maxsize=4096)
def split_layers(layers: int, p: int, split: str, head_eq: float = 0.0, embedding_eq: float = 0.0) -> tuple:
    """Blocks per stage, first to last (sums to ``layers``; a count may be 0 when the split is invalid)."""
    if split not in SPLITS:
        raise ValueError(f"pipeline split must be one of {'|'.join(SPLITS)}, got {split!r}")
    if p <= 1:
        return (layers,)
    if split == "even":
        return tuple(_even(layers, p))
    if split == "ends":
        return tuple(_ends(layers, p))
    return tuple(_balanced(layers, p, round(head_eq, 3), round(embedding_eq, 3)))


def edge_chunk_allowance(counts, ends: bool):
    """Virtual-stage chunks each stage may leave without a block: under the ``ends`` split the first stage's first
    chunk may hold only the embedding and the last stage's last chunk only the output head (Dubey et al. 2024
    §3.3.2: "the first model chunk on the first stage has only the embedding, and the last model chunk on the last
    stage has only output projection and loss calculation"); every other chunk needs a block."""
    edges = ends and len(counts) > 2
    return [1 if edges and i in (0, len(counts) - 1) else 0 for i in range(len(counts))]


def split_problem(counts, v: int = 1, ends: bool = False):
    """Why a split cannot run (a stage or a virtual-stage chunk without a block, beyond ``edge_chunk_allowance``),
    or None."""
    for i, (n, spare) in enumerate(zip(counts, edge_chunk_allowance(counts, ends))):
        if n < 1:
            return f"the split leaves pipeline stage {i} of {len(counts)} empty ({list(counts)} blocks per stage)"
        if n < v - spare:
            return (f"stage {i} holds {n} blocks, fewer than its {v} virtual stages: the split leaves a virtual "
                    f"stage empty")
    return None


def head_equivalent(model, seq_len: int) -> float:
    """The output head's forward FLOPs in blocks: 2·h·V / (2·P_mm + 4·s·h) (the split's pricing), with the
    multi-token-prediction modules that run next to it (planner/mtp.py)."""
    head = model.logits_forward_flops_per_token() + model.mtp_forward_flops_per_token(seq_len)
    return head / model.layer_forward_flops_per_token(seq_len)


def stage_layout(model, seq_len, pp, vpp, split):
    """Blocks per stage of every candidate (numpy arrays of pp and split codes): (first, last, largest middle
    stage) arrays; each distinct (pp, split) is split once."""
    rows, inverse = _by_layout(model, seq_len, pp, split,
                               lambda c: (c[0], c[-1], max(c[1:-1]) if len(c) > 2 else 0))
    table = np.array(rows, dtype=float).reshape(-1, 3)[inverse]
    return table[:, 0], table[:, 1], table[:, 2]


def _by_layout(model, seq_len, pp, split, fn) -> tuple:
    """``fn(blocks per stage)`` of every distinct (pp, split) among the candidates (each split once), and each
    candidate's index into that list."""
    head_eq = head_equivalent(model, seq_len)
    keys = (np.asarray(pp, dtype=np.int64) * 8 + np.asarray(split, dtype=np.int64)).reshape(-1)
    uniq, inverse = np.unique(keys, return_inverse=True)
    rows = [fn(split_layers(model.layers, int(k // 8), SPLITS[int(k % 8)], head_eq)) for k in uniq]
    return rows, inverse.reshape(-1)


def pair_layout(model, seq_len, pp, split):
    """DualPipe's pairs of stages per device (planner/dualpipe.py ``pair_blocks``): (blocks of stages 0 and p-1
    together, the most blocks of another rank's two stages) arrays; each distinct (pp, split) is split once."""
    rows, inverse = _by_layout(model, seq_len, pp, split, pair_blocks)
    table = np.array(rows, dtype=float).reshape(-1, 2)[inverse]
    return table[:, 0], table[:, 1]


def frontier(loads) -> tuple:
    """Rank 0's load (it holds the embedding and the head besides its blocks) and the other ranks' loads that no
    other rank's dominates (as many blocks held or more and as many in flight or more): a rank's memory grows with
    both, so only these can be the fullest."""
    rest = sorted(set(loads[1:]), reverse=True)
    kept = [load for load in rest if not any(o != load and o[0] >= load[0] and o[1] >= load[1] for o in rest)]
    return (loads[0],) + tuple(kept)


def pair_ranks(model, seq_len, pp, split):
    """DualPipe's per-rank loads (planner/dualpipe.py ``rank_loads``) of every candidate, as (held, in_flight,
    valid) arrays of shape (R, n): row 0 is rank 0's blocks held and block-micro-batches in flight, the next rows
    the other ranks that can be the fullest (``frontier``), ``valid`` False past a candidate's rows (and everywhere
    for PP < 2); each distinct (pp, split) is split once."""
    loads, inverse = _by_layout(model, seq_len, pp, split, lambda c: frontier(rank_loads(c)) if len(c) >= 2 else ())
    table = np.zeros((len(loads), max((len(x) for x in loads), default=1) or 1, 3))
    for i, rows in enumerate(loads):
        if rows:
            table[i, :len(rows)] = [(held, flight, 1.0) for held, flight in rows]
    rows = table[inverse].transpose(1, 2, 0)                 # (R, 3, n)
    return rows[:, 0], rows[:, 1], rows[:, 2] > 0
