"""``paddle.summary`` and hapi's ``Model.summary()`` over distributed models report what one process reports:
every row (input shape, output shape, parameter count) and the totals, under DP, TP, ZeRO 1-3 (after a step,
when ZeRO-3 has released its parameters), ``ap.parallelize`` and a pipeline (totals; rows per micro-batch).
Before: a tensor-parallel MLP reported 48 of its 92 parameters and ``[None]`` for a distributed input."""
import re

import numpy as np
import paddle
import pytest

import autoparallel as ap
from loops2_helpers import RUNS, One, XS, YS


def _rows(text: str) -> list:
    """The table rows with the per-process layer numbering (``Linear-13``) removed."""
    rows = [ln.split() for ln in text.splitlines() if re.match(r"\s*\w+-\d+\s", ln)]
    return [[re.sub(r"-\d+$", "", r[0])] + r[1:] for r in rows]


def _summary(env, capsys, hapi: bool):
    m = env.model()
    m, opt = env.wrap(m, paddle.optimizer.SGD(0.1, parameters=m.parameters()))
    loss = paddle.nn.functional.mse_loss(m(env.x(XS[0])), env.x(YS[0]))   # a step first: ZeRO-3 releases
    loss.backward()
    opt.step()
    opt.clear_grad()
    capsys.readouterr()
    info = paddle.Model(m).summary((8, 6)) if hapi else paddle.summary(m, (8, 6))
    return info, _rows(capsys.readouterr().out)


@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("hapi", [False, True])
def test_summary_equals_one_process(run, hapi, capsys):
    want = _summary(One(), capsys, hapi)
    with ap.simulate(world_size=4):
        got = _summary(RUNS[run](), capsys, hapi)
    assert want[0] == {"total_params": 92, "trainable_params": 92}
    assert got[0] == want[0]
    assert got[1] == want[1] and len(want[1]) == 2


def test_summary_of_a_layout_with_local_shapes_left_alone():
    """The forward inside the summary still sees local shapes (only paddle's hook reads global ones)."""
    from autoparallel.dist_tensor import DistParameter

    with ap.simulate(world_size=4):
        env = RUNS["parallelize tp"]()
        m = env.model()
        m, _ = env.wrap(m, paddle.optimizer.SGD(0.1, parameters=m.parameters()))
        paddle.summary(m, (8, 6))
        assert "shape" not in DistParameter.__dict__
        assert list(m.fc1.weight.shape) == [6, 4] and m.fc1.weight.global_shape == [6, 8]


def _gpt_summary(pp, tp, capsys):
    from autoparallel.testing.models import batch, build

    ids = paddle.to_tensor(batch(0)[0])
    paddle.seed(0)
    m = build("gpt")
    if pp:
        s = ap.Strategy()
        s.data_parallel.degree, s.pipeline_parallel.degree, s.tensor_parallel.degree = 4 // pp // tp, pp, tp
        m, _ = ap.parallelize(m, paddle.optimizer.AdamW(1e-2, parameters=m.parameters()), strategy=s)
    capsys.readouterr()
    info = paddle.summary(m, input=ids)
    return info, _rows(capsys.readouterr().out), m


@pytest.mark.parametrize("tp", [1, 2])
def test_summary_of_a_pipeline(tp, capsys):
    want_info, want_rows, _ = _gpt_summary(0, 1, capsys)
    with ap.simulate(world_size=4):
        info, rows, pipe = _gpt_summary(2, tp, capsys)
        assert pipe.training                  # summary puts the model back in training mode
    assert info == want_info
    layer_rows = [r for r in rows if r[0] != "PipelineStage"]
    assert [(r[0], r[-1]) for r in layer_rows] == [(r[0], r[-1]) for r in want_rows]
    total = sum(int(r[-1].replace(",", "")) for r in rows)
    assert total == want_info["total_params"] == int(np.sum([np.prod(p.shape) for p in build_params()]))


def build_params():
    from autoparallel.testing.models import build

    paddle.seed(0)
    return build("gpt").parameters()
