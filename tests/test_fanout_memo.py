"""The shared-input memo (comm/fanout.py) decides whether a collective runs, so every rank must forget the
same entries at the same call. Its keys are ids, which collide differently in every process: a rank whose
freed tensors' ids were reused holds fewer entries than its peer. Eviction by age keeps the ranks' hits
equal; the former eviction by size (clear when full) let one rank re-gather an input its peer still had,
and the peer waited in the next collective (a 4-rank training job hung in a gloo TIMEOUT)."""
import itertools
from collections import deque

import pytest

from autoparallel.comm import fanout


@pytest.fixture
def memo(monkeypatch):
    def fresh():
        monkeypatch.setattr(fanout, "_MEMO", {})
        monkeypatch.setattr(fanout, "_ORDER", deque())
        monkeypatch.setattr(fanout, "_INSERTED", itertools.count())
    return fresh


def _rank(calls, store, lookup):
    """Replay one rank's calls: ("store", key) or ("ask", key); returns the hits of the asks."""
    hits = []
    for what, key in calls:
        if what == "store":
            store(key, object())
        else:
            hits.append(lookup(key))
    return hits


def _calls(reused_ids: bool):
    """Two ranks run one program: 3 inputs per step are stored, then asked for again by a second consumer.
    Rank A's allocator reuses the id of the step's first input for the next step's (key 0 every step);
    rank B's does not (a new key every step)."""
    out = []
    for step in range(200):
        keys = [0 if reused_ids else ("x", step)] + [("y", step, i) for i in range(2)]
        out += [("store", k) for k in keys] + [("ask", k) for k in keys]
    return out


def test_ranks_with_different_id_reuse_hit_alike(memo):
    lookup = lambda k: fanout._memo(k) is not None            # noqa: E731
    memo()
    a = _rank(_calls(True), fanout._store, lookup)
    memo()
    b = _rank(_calls(False), fanout._store, lookup)
    assert a == b and all(a)


def test_eviction_is_by_age(memo):
    memo()
    for k in range(fanout._LIMIT + 5):
        fanout._store(k, k)
    assert fanout._memo(4) is None and fanout._memo(5) == 5      # the oldest 5 are forgotten, the rest kept
    assert len(fanout._MEMO) == fanout._LIMIT


def test_negative_control_eviction_by_size_diverges():
    """The former policy (clear when the table holds _LIMIT entries) on the same two ranks: their hits differ."""
    def run(calls):
        table = {}

        def store(k, v):
            if len(table) >= fanout._LIMIT:
                table.clear()
            table[k] = v
        return _rank(calls, store, lambda k: k in table)

    assert run(_calls(True)) != run(_calls(False))
