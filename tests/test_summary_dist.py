"""``paddle.summary`` / hapi ``Model.summary()`` on 4 real gloo ranks (job ``summary`` of the shared 4-rank launch,
dist_scripts/summary_worker.py): every rank reports one process's totals and rows under dp 2 x tp 2 and ZeRO-3
dp 4 after a step (released parameters), and a pipeline (pp 2 x dp 2) reports the whole model's totals on every
rank although each rank holds one stage (the other stage's layers holding parameters get their row without
shapes)."""
import os

import paddle
import pytest

from dist_scripts import shared_launch
from test_summary_forms import _rows

HERE = os.path.join(os.path.dirname(__file__), "dist_scripts")
JOB = shared_launch.job(__name__, "summary", os.path.join(HERE, "summary_worker.py"), 4, timeout=200)


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def _one(capsys, fn):
    capsys.readouterr()
    info = fn()
    return {k: int(v) for k, v in info.items()}, _rows(capsys.readouterr().out)


@pytest.mark.parametrize("case", ["tp2", "zero3", "zero3 hapi"])
def test_mlp_summary_equals_one_process(ranks, case, capsys):
    from loops2_helpers import MLP

    paddle.seed(3)
    want = _one(capsys, lambda: paddle.summary(MLP(), (8, 6)))
    for rank, r in enumerate(ranks):
        assert r[case]["info"] == want[0] == {"total_params": 92, "trainable_params": 92}, (rank, case)
        assert _rows(r[case]["text"]) == want[1], (rank, case)


def test_pipeline_summary_totals_equal_one_process(ranks, capsys):
    from autoparallel.testing.models import batch, build

    paddle.seed(0)
    want, rows = _one(capsys, lambda: paddle.summary(build("gpt"), input=paddle.to_tensor(batch(0)[0])))
    for rank, r in enumerate(ranks):
        got = r["pp2"]
        assert got["info"] == want, rank
        assert got["params_held"] < want["total_params"], rank          # this rank holds one stage only
        got_rows = [x for x in _rows(got["text"]) if x[0] != "PipelineStage"]
        with_params = sorted((x[0], x[-1]) for x in got_rows if x[-1] != "0")   # parameter-free layers of the
        assert with_params == sorted((x[0], x[-1]) for x in rows if x[-1] != "0"), rank   # other stage: no row
        assert any(x[-2] == "[0]" for x in got_rows), rank          # the other stage's rows: not run here
