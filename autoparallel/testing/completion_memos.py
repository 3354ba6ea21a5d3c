"""Completion as it runs without its memos (graph/completion: repeated ops' enumerations and unary prices,
repeated edges' reshard tables): every op enumerated and every reshard pair looked up. The reference the memos
are checked against (tests/test_completion_memo.py) and timed against (``python -m tools.bench completion-time``)."""
from __future__ import annotations

import contextlib

import numpy as np


def _pairwise(cost_model, specs, dsts, grad):
    return np.array([[cost_model.reshard(s, d, grad) for d in dsts] for s in specs],
                    dtype=float).reshape(len(specs), len(dsts))


@contextlib.contextmanager
def memos_off():
    """Inside: completion enumerates every op (no ``memo``) and prices every edge pair by pair."""
    import autoparallel.graph.completion.api as api
    from autoparallel.graph.completion.cost import CostModel

    cands, table = api.candidates, CostModel.reshard_table
    api.candidates = lambda *args, memo=None, **kwargs: cands(*args, **kwargs)
    CostModel.reshard_table = _pairwise
    try:
        yield
    finally:
        api.candidates, CostModel.reshard_table = cands, table
