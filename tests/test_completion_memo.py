"""Completion's memos (graph/completion): an op repeated in every block of a model is enumerated once per
completion (``candidates(..., memo=)``) and its unary prices computed once (build_problem), and an edge's reshard
table between the same layouts is priced once (``CostModel.reshard_table``). They must leave the plan exactly as
it is without them; tools/bench/completion_time.py measures what they save
(``autoparallel.testing.completion_memos.memos_off`` is the reference both use)."""
import numpy as np
import paddle
import paddle.nn as nn
import pytest

import autoparallel as ap
from autoparallel.graph.completion import CostModel, candidates, capture, complete, propagate
from autoparallel.graph.completion.candidate_layouts import _result_key
from autoparallel.planner.calibrate import cpu_profile
from autoparallel.testing.completion_memos import memos_off
from autoparallel.spec import DistSpec

R, S = ap.Replicate(), ap.Shard
CPU = cpu_profile(20e9, 10e9, 8e9, 4)
BLOCKS = 4


class Block(nn.Layer):
    def __init__(self, d):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.LayerNorm(d)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Layer):
    def __init__(self, d=16, n=BLOCKS):
        super().__init__()
        self.blocks = nn.LayerList([Block(d) for _ in range(n)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.mean()


ANNOTATIONS = {"blocks.0.up.weight": "[R, S(1)]", "blocks.2.down.weight": "[R, S(0)]"}


def _graph(annotations=None):
    with paddle.LazyGuard():
        net = Stack()
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    return net, capture(net, DistSpec(mesh, [S(0), R], (8, 4, 16)), annotations=annotations)


def _enumerations(annotations):
    """(distinct enumerations, ops), checking every op's memoised candidates against the plain ones."""
    _, g = _graph(annotations)
    known = propagate(g)
    memo = {}
    for k in sorted(g.nodes):
        got = candidates(g, k, known, memo=memo)
        want = candidates(g, k, known)
        assert [_result_key(r) for r in got] == [_result_key(r) for r in want], g.nodes[k]["op"]
    return len(memo), g.number_of_nodes()


def test_memoised_enumeration_equals_the_plain_one_and_is_shared_by_the_blocks():
    """From the third block on, every op reuses an enumeration; annotated blocks (a fixed weight, layouts
    propagated from it) enumerate apart from the free ones."""
    free, ops = _enumerations(None)
    per_block = (ops - 1) // BLOCKS                                        # and the final mean
    assert free <= 2 * per_block + 1
    annotated, _ = _enumerations(ANNOTATIONS)
    assert annotated > free


def test_reshard_table_is_the_pairwise_reshard_priced_once():
    _, g = _graph()
    cm = CostModel(g.graph["mesh"], CPU)
    spec = DistSpec(g.graph["mesh"], [S(0), R], (8, 4, 16))
    specs = (spec, spec.with_placements([R, S(2)]), spec.with_placements([S(0), ap.Partial("sum")]))
    dsts = ((R, R), (S(0), S(2)), (S(0), R), (R, S(1)))
    for grad in (False, True):
        table = cm.reshard_table(specs, dsts, grad)
        want = np.array([[cm.reshard(s, d, grad) for d in dsts] for s in specs])
        np.testing.assert_array_equal(table, want)
        assert table[0, 2] == 0.0 and table[1, 0] > 0.0          # as stored: free; a gather: not
        assert cm.reshard_table(specs, dsts, grad) is table and not table.flags.writeable


def test_plan_with_the_memos_equals_the_plan_without():
    net, g = _graph()
    spec = DistSpec(g.graph["mesh"], [S(0), R], (8, 4, 16))
    with_memo = complete(net, spec, annotations=ANNOTATIONS, cluster=CPU)
    with memos_off():
        without = complete(net, spec, annotations=ANNOTATIONS, cluster=CPU)
    assert with_memo.cost == pytest.approx(without.cost, rel=0, abs=0)
    assert {k: _result_key(r) for k, r in with_memo.results.items()} == \
           {k: _result_key(r) for k, r in without.results.items()}
    assert with_memo.source_layouts == without.source_layouts
