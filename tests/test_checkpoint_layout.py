"""``ap.load_state_dict`` given per-rank directories (each rank's own save, ``<root>/rank<r>``), one of them, or
a directory whose checkpoints are one level down: a typed CheckpointLayoutError naming the layout it found and
the call that loads it, with nothing loaded. Before: the parent was refused with a bare 'no complete checkpoint'
and one rank's directory loaded silently, filling every rank from that rank's save alone."""
import os

import numpy as np
import pytest

import autoparallel as ap
from autoparallel.checkpoint import CheckpointLayoutError, CheckpointManager

HINT = ("A checkpoint of autoparallel is one directory that every rank of a job writes together "
        "(ap.save_state_dict with the same path on every rank), and it loads into any layout; a run root is "
        "resumed with CheckpointManager(dir=<the run root>).restore(state) (or ap.load_state_dict(state, <the run "
        "root>)). Nothing was loaded")


def _state(value: float) -> dict:
    return {"w": np.full((2, 2), value, dtype=np.float32)}


def _per_rank_saves(root: str, ranks: int = 2) -> None:
    """What ``ap.save_state_dict(state, f"{root}/rank{r}")`` leaves when each rank saves on its own."""
    for r in range(ranks):
        ap.save_state_dict(_state(float(r + 1)), os.path.join(root, f"rank{r}"))


def _refused(path: str) -> str:
    target = _state(0.0)
    with pytest.raises(CheckpointLayoutError) as e:
        ap.load_state_dict(target, path)
    np.testing.assert_array_equal(target["w"], np.zeros((2, 2), dtype=np.float32))     # nothing loaded
    assert isinstance(e.value, FileNotFoundError)          # what a missing checkpoint raised before
    return str(e.value)


def test_the_parent_of_per_rank_directories_names_them_and_the_call(tmp_path):
    root = str(tmp_path / "ck")
    _per_rank_saves(root)
    assert _refused(root) == (f"{root!r} holds per-rank directories, each its own save: rank0 (a checkpoint), "
                              f"rank1 (a checkpoint). Each was written by one rank alone, so none of them is the "
                              f"job's state and they are not loaded as one. {HINT}")


def test_one_rank_directory_among_several_is_refused_not_loaded_alone(tmp_path):
    root = str(tmp_path / "ck")
    _per_rank_saves(root, ranks=3)
    assert _refused(os.path.join(root, "rank1")) == (
        f"{os.path.join(root, 'rank1')!r} is one of the per-rank directories ['rank0', 'rank1', 'rank2'] in "
        f"{root!r}, each its own save: loading it would fill this process from rank 1's save alone, a part of the "
        f"job's state. {HINT}")
    assert "rank 2's save alone" in _refused(os.path.join(root, "rank2", "metadata.json"))


def test_per_rank_run_roots_are_named_with_their_steps(tmp_path):
    root = str(tmp_path / "ck")
    for r in range(2):
        m = CheckpointManager(os.path.join(root, f"rank_{r}"), save_interval_steps=1)
        m.save(_state(float(r)), 5)
        m.save(_state(float(r)), 7)
    assert _refused(root).startswith(f"{root!r} holds per-rank directories, each its own save: rank_0 (a run root "
                                     f"(steps [5, 7])), rank_1 (a run root (steps [5, 7])).")
    assert "from rank 0's save alone" in _refused(os.path.join(root, "rank_0"))


def test_a_checkpoint_one_level_down_is_named_not_picked(tmp_path):
    root = str(tmp_path / "runs")
    ap.save_state_dict(_state(4.0), os.path.join(root, "best"))
    assert _refused(root) == (f"{root!r} holds no checkpoint itself, but its sub-directories do: best (a "
                              f"checkpoint); pass the one to load. {HINT}")


def test_negative_control_a_lone_rank_directory_and_the_shared_checkpoint_load(tmp_path):
    root = str(tmp_path / "ck")
    _per_rank_saves(root, ranks=1)                         # rank0 alone: a checkpoint like any other
    target = _state(0.0)
    ap.load_state_dict(target, os.path.join(root, "rank0"))
    np.testing.assert_array_equal(target["w"], np.full((2, 2), 1.0, dtype=np.float32))
    os.makedirs(os.path.join(root, "rank1"))               # an empty peer holds no save: still loads
    ap.load_state_dict(target, os.path.join(root, "rank0"))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in") as e:   # nothing below: as before
        ap.load_state_dict(target, str(tmp_path / "ck" / "rank1"))
    assert not isinstance(e.value, CheckpointLayoutError)


def test_a_manager_resuming_from_the_parent_of_per_rank_run_roots_is_refused_not_started_afresh(tmp_path):
    root = str(tmp_path / "ck")
    for r in range(2):
        CheckpointManager(os.path.join(root, f"rank{r}"), save_interval_steps=1).save(_state(float(r + 1)), 3)
    target = _state(0.0)
    with pytest.raises(CheckpointLayoutError, match=r"holds per-rank directories, each its own save: rank0 \(a run "
                                                    r"root \(steps \[3\]\)\), rank1"):
        CheckpointManager(root).restore(target)
    np.testing.assert_array_equal(target["w"], np.zeros((2, 2), dtype=np.float32))
    assert CheckpointManager(str(tmp_path / "fresh")).restore(target) is None     # nothing anywhere: a new run
    leftover = tmp_path / "interrupted"                      # a save's temporary directory is no checkpoint to name
    ap.save_state_dict(_state(1.0), str(leftover / "step-00000001.tmp-0123456789ab"))
    assert CheckpointManager(str(leftover)).restore(target) is None
