"""Crash safety by fault injection (the writer SIGKILLs itself at each named phase of a save), and the
CheckpointManager: periodic saves, keep_last, newest-complete resume, stop requests."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import autoparallel as ap
from autoparallel.checkpoint import CheckpointManager, load_state_dict, read_checkpoint_info
from autoparallel.checkpoint.atomic import PHASES
from autoparallel.checkpoint.discovery import incomplete_checkpoints
from autoparallel.testing.launch import child_env
from dist_scripts.ckpt_common import DP2_TP2, TP2, build_state, check_state, full_tensors

HERE = os.path.dirname(__file__)
WRITER = os.path.join(HERE, "dist_scripts", "ckpt_fault_writer.py")


def _state(step):
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"])
    return build_state(mesh, DP2_TP2, full_tensors(seed=step))


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """Per phase: a root holding a complete step-1 checkpoint and a step-2 save killed at that phase."""
    roots, procs = {}, {}
    for phase in PHASES:
        root = str(tmp_path_factory.mktemp(phase))
        with ap.simulate(world_size=4):
            CheckpointManager(root, save_interval_steps=1).save(_state(1), 1)
        env = child_env(dict(AP_CKPT_FAULT=phase, OMP_NUM_THREADS="1"))
        procs[phase] = subprocess.Popen([sys.executable, WRITER, root, "2"], env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT)
        roots[phase] = root
    out = {}
    for phase, p in procs.items():
        log, _ = p.communicate(timeout=120)
        out[phase] = (roots[phase], p.returncode, log.decode(errors="replace"))
    return out


def _only_temp(root):
    temps = incomplete_checkpoints(root)
    assert len(temps) == 1, temps
    return temps[0]


def _load_on_2_ranks(root):
    with ap.simulate(world_size=2):
        target = build_state(ap.ProcessMesh([0, 1], ["tp"]), TP2)
        info = CheckpointManager(root).restore(target)
    return info, target


@pytest.mark.parametrize("phase", PHASES)
def test_kill_at_each_phase_keeps_the_previous_checkpoint(crashed, phase):
    root, code, log = crashed[phase]
    assert code == -signal.SIGKILL, log
    full_size = os.path.getsize(os.path.join(root, "step-00000001", "data-r00000.bin"))
    if phase == "after_dir_rename":
        # the new checkpoint is complete; only the 'latest' pointer lags, and resume does not trust it
        assert open(os.path.join(root, "latest")).read().strip() == "step-00000001"
        expected_step = 2
    else:
        tmp = _only_temp(root)
        files = set(os.listdir(tmp)) - {".autoparallel-checkpoint"}     # the marker is written first
        assert os.path.exists(os.path.join(tmp, ".autoparallel-checkpoint"))
        assert os.path.basename(tmp).startswith("step-00000002.tmp-")
        assert not os.path.exists(os.path.join(root, "step-00000002"))
        size = os.path.getsize(os.path.join(tmp, "data-r00000.bin"))
        if phase == "shard_half_written":
            assert 0 < size < full_size and files == {"data-r00000.bin"}
        elif phase == "shard_before_fsync":
            assert size == full_size and files == {"data-r00000.bin"}
        elif phase == "before_metadata_rename":
            assert files == {f"data-r0000{r}.bin" for r in range(4)} | {"metadata.json.tmp"}
        else:
            assert files == {f"data-r0000{r}.bin" for r in range(4)} | {"metadata.json"}
        expected_step = 1
    info, target = _load_on_2_ranks(root)
    assert info.step == expected_step
    assert open(os.path.join(root, "latest")).read().strip() == f"step-0000000{expected_step}"   # agrees now
    assert check_state(target, full_tensors(seed=expected_step)) == []
    assert check_state(target, full_tensors(seed=3 - expected_step))     # and not the other one


@pytest.mark.parametrize("phase", PHASES)
def test_a_retried_save_succeeds_and_cleans_up(crashed, phase):
    root = crashed[phase][0]
    with ap.simulate(world_size=4):
        mgr = CheckpointManager(root, save_interval_steps=1)
        mgr.start(resume=True)                       # removes the killed save's leftovers
        assert incomplete_checkpoints(root) == []
        mgr.save(_state(2), 2)
    assert incomplete_checkpoints(root) == []
    assert open(os.path.join(root, "latest")).read().strip() == "step-00000002"
    info, target = _load_on_2_ranks(root)
    assert info.step == 2 and check_state(target, full_tensors(seed=2)) == []


def test_manager_interval_keep_last_and_resume(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ck"), save_interval_steps=2, keep_last=2)
    saved = [s for s in range(1, 8) if mgr.maybe_save({"x": np.full(3, float(s))}, s, extra={"pos": s})]
    assert saved == [2, 4, 6]
    assert mgr.steps() == [4, 6]                     # keep_last=2 pruned step 2
    target = {"x": np.zeros(3)}
    info = mgr.restore(target)
    assert info.step == 6 and info.extra == {"pos": 6} and target["x"].tolist() == [6.0] * 3
    assert read_checkpoint_info(str(tmp_path / "ck")).step == 6
    assert CheckpointManager(str(tmp_path / "none")).restore(target) is None


def test_manager_from_strategy_and_bad_settings(tmp_path):
    s = ap.Strategy()
    s.checkpoint.enable = True
    s.checkpoint.save_interval_steps = 5
    s.checkpoint.dir = str(tmp_path / "c")
    s.checkpoint.keep_last = 3
    mgr = CheckpointManager.from_strategy(s)
    assert (mgr.dir, mgr.save_interval_steps, mgr.keep_last, mgr.enable) == (str(tmp_path / "c"), 5, 3, True)
    assert [t for t in range(1, 16) if mgr.should_save(t)] == [5, 10, 15]
    with pytest.raises(ValueError, match="save_interval_steps must be a positive int, got 0"):
        CheckpointManager(str(tmp_path), save_interval_steps=0)
    with pytest.raises(ValueError, match="keep_last must be a positive int or None"):
        CheckpointManager(str(tmp_path), keep_last=0)


def test_sigterm_becomes_a_stop_request(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "c"), save_interval_steps=100)
    mgr.install_sigterm_handler()
    try:
        assert not mgr.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.should_stop()
    finally:
        mgr.uninstall_sigterm_handler()
    path = mgr.save({"x": np.ones(2)}, 37)           # the final checkpoint, off the interval
    assert os.path.basename(path) == "step-00000037"
    target = {"x": np.zeros(2)}
    assert load_state_dict(target, mgr.dir).step == 37


def test_a_failure_after_the_commit_rename_says_the_checkpoint_is_complete(tmp_path, monkeypatch):
    """A full disk at the directory's fsync after the rename: the error says the checkpoint is complete on disk
    (it said nothing was committed) and the checkpoint loads."""
    from autoparallel.checkpoint import CheckpointSaveError

    path = str(tmp_path / "ck")
    monkeypatch.setenv("AP_CKPT_FAULT", "after_dir_rename:enospc")
    with ap.simulate(world_size=4), pytest.raises(CheckpointSaveError) as e:
        ap.save_state_dict(_state(1), path)
    assert str(e.value).endswith("rank 0 failed after the commit's rename: OSError: [Errno 28] No space left on device "
                                 "(injected at after_dir_rename); the checkpoint is complete on disk, but its "
                                 "directory entry may not be durable (a crash now could lose it)"), str(e.value)
    monkeypatch.delenv("AP_CKPT_FAULT")
    with ap.simulate(world_size=2):
        target = build_state(ap.ProcessMesh([0, 1], ["tp"]), TP2)
        load_state_dict(target, path)
    assert check_state(target, full_tensors(seed=1)) == []
