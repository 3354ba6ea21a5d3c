"""Saves whose path is not one directory for every rank, and a Ctrl-C inside a save, on 2 real gloo ranks (one
shared launch; dist_scripts/ckpt_fresh_worker.py). Each rank runs in a working directory of its own.

Before: a relative path (resolved in each rank's working directory), or a path on a node-local filesystem (played
by ``/proc/self/cwd/...``: the same text on both ranks, another directory on each), left every rank polling for the
other's files until AP_CKPT_TIMEOUT, an hour by default (measured with AP_CKPT_TIMEOUT=25: rank 0 raised
CheckpointSaveError after 44 s, rank 1 a bare TimeoutError after 39 s and kept its partial directory); every rank
was alive, so the watchdog had no one to name. Now every rank raises a typed error naming the ranks and paths
within VISIBLE_WAIT_S + the exchange, before any rank writes (shared_dir.py); CheckpointManager.start refuses
such a root before the first step, and before rank 0 marks it; CheckpointManager.restore compares the save
that wrote each rank's checkpoint, not only its path."""
import os

import pytest

from autoparallel.checkpoint.shared_dir import VISIBLE_WAIT_S
from dist_scripts import shared_launch

WORKER = os.path.join(os.path.dirname(__file__), "dist_scripts", "ckpt_fresh_worker.py")
JOB = shared_launch.job(__name__, "ckpt_fresh", WORKER, 2, args=lambda out: [out], timeout=120)
SECONDS = VISIBLE_WAIT_S + 8.0      # the probe wait, the exchanges and a loaded machine; the default wait was 3600 s
BLIND = "rank 0 does not see the files of ranks [1]; rank 1 does not see the files of ranks [0]"
CKPT_FILES = [".autoparallel-checkpoint", "data-r00000.bin", "data-r00001.bin", "metadata.json"]


@pytest.fixture(scope="module")
def launched():
    return shared_launch.results(JOB)


def test_a_relative_path_under_different_working_directories_fails_on_every_rank_at_once(launched):
    out, ranks = launched
    paths = [os.path.join(out, f"node{r}", "ck-relative") for r in range(2)]
    for r, got in enumerate(ranks):
        text, seconds = got["relative"]
        assert text.startswith(f"CheckpointSaveError: checkpoint {paths[r]}: {os.path.dirname(paths[r])!r} is not "
                               f"one directory every rank sees: {BLIND}. The ranks' paths differ (rank 0: "
                               f"{paths[0]}, rank 1: {paths[1]})"), text
        assert text.endswith("No rank wrote any of the checkpoint") and seconds < SECONDS, (text, seconds)


def test_a_node_local_directory_fails_on_every_rank_naming_who_cannot_see_whom(launched):
    _, ranks = launched
    for got in ranks:
        text, seconds = got["node_local"]
        assert text.startswith("CheckpointSaveError: checkpoint /proc/self/cwd/ck-node-local: '/proc/self/cwd' "
                               f"is not one directory every rank sees: {BLIND}. A multi-process save"), text
        assert "paths differ" not in text            # the same text on both ranks
        assert seconds < SECONDS, seconds


def test_a_node_local_run_root_is_refused_at_start_before_it_is_marked(launched):
    _, ranks = launched
    for got in ranks:
        text, seconds = got["manager_node_local"]
        assert text.startswith("CheckpointRootError: checkpoint root '/proc/self/cwd/run'"), text
        assert "rank 0 does not see the files of ranks [1]" in text and seconds < SECONDS, (text, seconds)
        assert got["own_listing"] == ["run"]        # no partial directory, probe or run marker on either rank


def test_reshard_state_through_node_local_scratch_fails_on_every_rank_at_once(launched):
    """reshard_state's scratch (default /dev/shm: node-local) played by tmp_dir="/proc/self/cwd". After the save's
    refusal, rank 0 used to wait for every rank's "loaded" marker, which the other rank writes in its own
    directory (measured before this: rank 0 still in 'checkpoint rendezvous' after 44 s, rank 1's next
    collective ended by gloo's 30 s timeout, the job killed by the watchdog, exit 75); a failed save now removes
    the scratch without waiting, as it fails on every rank."""
    _, ranks = launched
    for got in ranks:
        text, seconds = got["reshard_node_local"]
        assert text.startswith("CheckpointSaveError: checkpoint /proc/self/cwd/ap-reshard-"), text
        assert "is not one directory every rank sees" in text and seconds < SECONDS, (text, seconds)
        assert got["own_listing"] == ["run"]        # the scratch removed on both ranks


def test_negative_control_the_same_calls_in_a_shared_directory_succeed(launched):
    _, ranks = launched
    for got in ranks:
        assert got["shared_relative"][0] == "ok" and got["shared_manager"][0] == "ok", got
        run = [".autoparallel-run", "latest", "step-00000001"] + [f"step-00000001/{f}" for f in CKPT_FILES]
        assert got["shared_listing"] == ["ck"] + [f"ck/{f}" for f in CKPT_FILES] + ["run"] + [
            f"run/{f}" for f in run]                # every probe file removed


def test_a_ctrl_c_in_one_ranks_write_fails_the_save_everywhere_and_keeps_the_old_checkpoint(launched):
    _, ranks = launched
    assert ranks[1]["interrupted_overwrite"][0] == "KeyboardInterrupt: "
    text = ranks[0]["interrupted_overwrite"][0]
    assert text.startswith("CheckpointSaveError") and "writing failed on rank 1: KeyboardInterrupt" in text, text
    for got in ranks:
        assert got["interrupted_overwrite"][1] < SECONDS
        assert got["after_interrupt"] == {"w": [[1.0, 1.0]] * 4, "loader": {"index": 1}}    # step 1's values
        assert got["loaded_step"] == 1 and got["loaded_local"] == [[1.0, 1.0]] * 2


def test_a_resume_from_node_local_roots_holding_other_saves_is_refused(launched):
    """Each rank's root held a step-1 checkpoint of another save under the same path (rank 0's w = 1, rank 1's
    w = 3): restore() compared the paths only and loaded each rank's own (measured before: rank 0's rows 1.0,
    rank 1's rows 3.0, one tensor mixing two saves, no error). The ranks now compare the saves' nonces too."""
    _, ranks = launched
    for got in ranks:
        text, _ = got["node_local_restore"]
        assert text.startswith("CheckpointError: checkpoint root '/proc/self/cwd/run2': the ranks would resume "
                               "from different checkpoints"), text
        assert text.count("/proc/self/cwd/run2/step-00000001 (save ") == 2 and "Nothing was loaded" in text, text
        assert got["node_local_restore_w"] == [[0.0, 0.0]] * 2            # the state left as it was
