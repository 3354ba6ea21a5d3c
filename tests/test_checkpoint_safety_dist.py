"""Checkpoint data safety on 2 real gloo ranks (one launch, several checks; dist_scripts/ckpt_safety_worker.py):
a full disk on rank 1 fails the save on both ranks and leaves no partial directory, a second run and a root
that is a file are refused on both ranks with the same typed error, and resuming continues the run."""
import os

import pytest

from dist_scripts import shared_launch

WORKER = os.path.join(os.path.dirname(__file__), "dist_scripts", "ckpt_safety_worker.py")
ROOT_ENTRIES = [".autoparallel-run", "latest", "step-00000001"]
JOB = shared_launch.job(__name__, "ckpt_safety", WORKER, 2, args=lambda out: [os.path.join(out, "run")], timeout=300)


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def test_a_save_failing_on_one_rank_fails_everywhere_and_leaves_no_partial(ranks):
    assert [r["start"] for r in ranks] == ["ok", "ok"] and [r["save1"] for r in ranks] == ["ok", "ok"]
    r0, r1 = ranks[0]["save2_disk_full"], ranks[1]["save2_disk_full"]
    assert r1.startswith("OSError: [Errno 28] No space left on device"), r1
    assert r0.startswith("CheckpointSaveError") and "writing failed on rank 1: OSError: [Errno 28]" in r0, r0
    assert [r["after_failure"] for r in ranks] == [ROOT_ENTRIES, ROOT_ENTRIES]


def test_a_second_run_and_a_file_root_are_refused_on_every_rank(ranks):
    for r in ranks:
        assert r["second_run"].startswith("CheckpointOwnershipError") and "steps [1]" in r["second_run"], r
        assert r["root_is_file"].startswith("CheckpointRootError") and "is a file" in r["root_is_file"], r


def test_resume_continues_the_run_and_latest_names_the_newest(ranks):
    for r in ranks:
        assert r["resumed_step"] == 1 and r["resumed_index"] == 1 and r["save2"] == "ok"
        assert r["final"] == [".autoparallel-run", "latest", "step-00000001", "step-00000002"]
        assert r["latest"] == "step-00000002"
        assert r["merged_w"] == [[2.0, 2.0]] * 4
