"""The file rendezvous of a multi-process save, with the ranks of a job played by threads: ranks finish
writing at different times and rank 0 commits after the last; a rank whose write fails stops the save at
once with an error naming it."""
import copy
import os
import threading
import time

import numpy as np
import pytest

import autoparallel as ap
import autoparallel.checkpoint.save as save_module
from autoparallel.checkpoint import CheckpointSaveError, load_merged_state_dict
from autoparallel.checkpoint.collect import collect
from autoparallel.checkpoint.discovery import incomplete_checkpoints
from autoparallel.checkpoint.flatten import flatten
from dist_scripts.ckpt_common import DP2_TP2, build_state, full_tensors

FULL = full_tensors(seed=3)


def _run_ranks(final, nonce="0123456789ab", delays=(0.0, 0.3, 0.1, 0.2)):
    """Every rank's part of a 4-rank save, one thread per rank; returns {rank: exception or None}."""
    with ap.simulate(world_size=4):
        state = build_state(ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"]), DP2_TP2, FULL)
        tensors, values, writes = collect(flatten(state), 0, False)
    meta = {"format": "autoparallel.checkpoint", "version": 1, "step": 4, "extra": None, "nonce": nonce,
            "world_size": 4, "created": 0.0, "tensors": tensors, "values": values, "files": {}}
    tmp = save_module.temp_dir_for(final, nonce)
    save_module.os.makedirs(tmp)
    errors = {}

    def rank(r):
        time.sleep(delays[r])
        try:
            save_module._save_multi(copy.deepcopy(meta), tmp, final, False, r, 4, writes.get(r, []), 1 << 20)
            errors[r] = None
        except Exception as e:
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def test_rank_zero_commits_after_the_slowest_writer(tmp_path):
    final = str(tmp_path / "ck")
    errors = _run_ranks(final)
    assert errors == {0: None, 1: None, 2: None, 3: None}
    merged = load_merged_state_dict(final)
    for name, value in merged["model"].items():
        np.testing.assert_array_equal(value, FULL[name])
    assert merged["loader"] == {"epoch": 2, "index": 640}
    assert incomplete_checkpoints(str(tmp_path)) == []


def test_a_failed_writer_stops_the_save_and_is_named(tmp_path, monkeypatch):
    original = save_module.write_rank_file

    def failing(directory, rank, items, block_bytes):
        if rank == 2:
            raise OSError(28, "No space left on device")
        return original(directory, rank, items, block_bytes)

    monkeypatch.setattr(save_module, "write_rank_file", failing)
    final = str(tmp_path / "ck")
    start = time.monotonic()
    errors = _run_ranks(final)
    assert time.monotonic() - start < 5                  # not AP_CKPT_TIMEOUT
    assert isinstance(errors[2], OSError)
    assert isinstance(errors[0], CheckpointSaveError)
    assert "writing failed on rank 2: OSError: [Errno 28] No space left on device" in str(errors[0])
    for r in (1, 3):
        assert isinstance(errors[r], CheckpointSaveError) and "rank 0 could not commit" in str(errors[r])
    assert os.listdir(tmp_path) == []                   # rank 0 removed the temporary directory
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_merged_state_dict(str(tmp_path))
