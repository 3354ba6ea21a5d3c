"""The default-on collective log on 2 real gloo ranks (one shared-launch job, dist_scripts/collective_log_worker.py):
a rank-0-only tensor-parallel evaluation forward that pairs silently with rank 1's forward of the same size is
named by the watchdog's judge on both ranks within two heartbeats plus one of grace, and the checkpoint saved
after it is refused at its entry, nothing written; training from one line stays quiet (the negative control)."""
import os

import pytest

from dist_scripts import shared_launch

HERE = os.path.join(os.path.dirname(__file__), "dist_scripts")
JOB = shared_launch.job(__name__, "collective_log", os.path.join(HERE, "collective_log_worker.py"), 2,
                        args=lambda out: [out], timeout=120)


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def test_equal_training_steps_pass_several_heartbeats(ranks):
    for r in ranks:
        assert r["quiet"]["exits"] == 0 and r["quiet"]["beats"] >= 3


def test_a_rank0_only_evaluation_forward_ends_every_rank_with_the_named_error(ranks):
    for rank, r in enumerate(ranks):
        judged = r["judged"]
        assert judged["exit"] == 75, (rank, judged)
        text = judged["failure"]
        assert "CollectiveMismatchError: the ranks of group [0,1] did not make the same collective" in text
        assert "every rank must make the same collectives in the same order" in text
        line0, line1 = _lines("evaluate(m, data[2][0])"), _lines("m(paddle.to_tensor(data[2][0]))     #")
        assert f"collective_log_worker.py:{line0}" in text and f"collective_log_worker.py:{line1}" in text
        assert "all_reduce@" in text and "bytes)" in text
        assert judged["seconds"] < 3 * judged["interval"] + 2.0, judged     # 2 heartbeats + 1 of grace (+ load)
        assert r["pending"] == "CollectiveMismatchError"       # raised at this rank's next collective


def test_no_checkpoint_is_written_after_the_mismatch(ranks):
    for r in ranks:
        assert not r["save"]["written"]
        assert r["save"]["error"].startswith("CollectiveMismatchError: refusing to save a checkpoint: on group "
                                             "[0,1], rank 0 has made"), r["save"]
        assert "with different calls" in r["save"]["error"]


def _lines(snippet: str) -> int:
    with open(os.path.join(HERE, "collective_log_worker.py")) as f:
        return next(n for n, line in enumerate(f, 1) if snippet in line)
