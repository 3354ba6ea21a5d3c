"""Failures on some ranks only, on 2 real gloo ranks (one shared launch; dist_scripts/ckpt_rank_only_worker.py):
the in-process threads of tests/test_checkpoint_rank_only.py stand for ranks, this checks the same through gloo.
Before: rank 0's failing 'latest' write raised a bare OSError on rank 0 while rank 1 went on (its next
collective waited for gloo's 30 s timeout), rank 0's failed metadata write was a bare OSError on rank 0, and
rank 1's failed load raised on rank 1 alone while rank 0 kept the loaded values, and rank 0 failing after the commit's
rename raised on rank 0 alone (rank 1 had seen the commit)."""
import os

import pytest

from dist_scripts import shared_launch

WORKER = os.path.join(os.path.dirname(__file__), "dist_scripts", "ckpt_rank_only_worker.py")
JOB = shared_launch.job(__name__, "ckpt_rank_only", WORKER, 2, args=lambda out: [os.path.join(out, "run")],
                        timeout=200)
ENOSPC = "OSError: [Errno 28] No space left on device"


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def test_latest_failing_on_rank_zero_is_a_typed_error_on_both_ranks_and_the_old_latest_stays(ranks):
    for r in ranks:
        assert r["save1"]["outcome"] == "ok"
        got = r["latest_fails_on_rank0"]["outcome"]
        assert got.startswith("CheckpointSaveError: checkpoint ") and got.endswith(
            "/step-00000002 is saved, but updating its run root after it (rank 0 only) failed on rank 0: OSError: "
            "[Errno 28] writing 'latest' (it still names the previous checkpoint; nothing was pruned): No space "
            "left on device"), got
        assert r["latest"] == "step-00000001"
        assert r["after_latest_failure"] == [".autoparallel-run", "latest", "step-00000001", "step-00000002"]


def test_rank_zeros_metadata_on_a_full_disk_is_typed_on_both_ranks_and_keeps_the_old_checkpoint(ranks):
    cause = f"{ENOSPC} (injected at before_metadata_rename)"
    r0, r1 = (r["metadata_fails_on_rank0"]["outcome"] for r in ranks)
    assert r0.startswith("CheckpointSaveError: checkpoint ") and r0.endswith(
        f"/one: rank 0 could not commit: {cause}; nothing was committed"), r0
    assert r1.startswith("CheckpointSaveError: checkpoint ") and r1.endswith(f"/one: rank 0 could not commit: {cause}")
    for rank, r in enumerate(ranks):                 # the old checkpoint (5.0) loads on both ranks
        assert r["one_saved"]["outcome"] == r["one_after"]["outcome"] == "ok"
        assert r["one_after_w"] == [[5.0, 5.0], [5.0, 5.0]]


def test_rank_one_gets_rank_zeros_error_when_its_failure_note_could_not_be_written(ranks):
    """Rank 0's note on a full disk fails too: rank 1 saw only the temporary directory removed and said so, with
    no cause; the save's status exchange now carries rank 0's error."""
    r0, r1 = (r["note_fails_on_rank0"]["outcome"] for r in ranks)
    cause = f"{ENOSPC} (injected at before_metadata_rename)"
    assert r0.endswith(f"/one: rank 0 could not commit: {cause}; nothing was committed"), r0
    assert r1.startswith("CheckpointSaveError: checkpoint ") and (
        "/one: rank 0 could not commit: its temporary directory was removed without a commit; rank 0 reported: "
        "CheckpointSaveError: checkpoint " in r1) and r1.endswith(f"{cause}; nothing was committed"), r1


def test_rank_zero_failing_after_the_commit_is_typed_on_both_ranks_at_once(ranks):
    """Rank 1 had seen the commit and returned; rank 0 raised alone and rank 1's next collective waited for gloo's
    30 s. Now both raise from the save's status exchange, and the checkpoint (complete on disk) loads."""
    r0, r1 = (r["after_commit_fails_on_rank0"] for r in ranks)
    cause = f"{ENOSPC} (injected at after_dir_rename)"
    assert r0["outcome"].startswith("CheckpointSaveError: checkpoint ") and r0["outcome"].endswith(
        f"/two: rank 0 failed after the commit's rename: {cause}; the checkpoint is complete on disk, but its "
        f"directory entry may not be durable (a crash now could lose it)"), r0
    assert r1["outcome"].startswith("CheckpointSaveError: checkpoint ") and (
        "/two: the save failed on rank 0: CheckpointSaveError: checkpoint " in r1["outcome"]) and (
        "failed after the commit's rename" in r1["outcome"]), r1
    assert r1["seconds"] < 20, r1                    # not gloo's 30 s
    for rank, r in enumerate(ranks):
        assert r["after_commit_collective"]["outcome"] == "ok" and r["two_loaded"]["outcome"] == "ok"
        assert r["two_w"] == [[7.0, 7.0], [7.0, 7.0]]


def test_a_load_failing_on_rank_one_fails_both_with_nothing_loaded(ranks):
    r0, r1 = (r["load_fails_on_rank1"]["outcome"] for r in ranks)
    assert r1.startswith("CheckpointMismatchError: ") and "'w'" in r1, r1
    assert r0 == r1.replace("CheckpointMismatchError: ", "CheckpointMismatchError: (rank 1) ", 1), r0
    assert ranks[0]["load_fails_w"] == [[0.0, 0.0], [0.0, 0.0]]
    assert ranks[1]["load_fails_w"] == [[0.0, 0.0]] * 3


def test_negative_control_the_job_goes_on(ranks):
    for r in ranks:
        assert r["load_ok"]["outcome"] == "ok" and r["load_ok_w"] == [[1.0, 1.0], [1.0, 1.0]]
        assert r["save3"]["outcome"] == "ok"
        assert r["final"] == [".autoparallel-run", "latest", "step-00000003"]
        assert r["all_reduce"] == 3.0
