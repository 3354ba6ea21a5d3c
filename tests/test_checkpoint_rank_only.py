"""Steps of a collective save or restore that rank 0 alone performs (the metadata and commit, the ``latest``
pointer, pruning, the pointer's repair after a restore), failing on rank 0 only: every rank raises a typed
error naming rank 0 and the cause, and the previous checkpoint, with the ``latest`` that names it, still loads.
The ranks of a job are played by threads of this process (tests/ckpt_peers.py: ``sync.job()`` answers each
thread's rank, ``all_gather`` exchanges between the threads).

Before: rank 0 raised the bare OSError on its own and the other ranks went on into their next collective, where
gloo's 30 s timeout or the watchdog ended the job; a failed metadata write reached rank 0's caller as a bare
OSError; pruning removed an old checkpoint before ``latest`` was rewritten, so a failed pointer write left
``latest`` naming a removed checkpoint."""
import copy
import errno
import os
import threading

import numpy as np
import pytest

import autoparallel as ap
import autoparallel.checkpoint.manager as manager_module
import autoparallel.checkpoint.run_root as run_root_module
import autoparallel.checkpoint.save as save_module
from autoparallel.checkpoint import (CheckpointError, CheckpointManager, CheckpointMismatchError, CheckpointSaveError,
                                     sync)
from autoparallel.checkpoint.collect import collect
from autoparallel.checkpoint.discovery import incomplete_checkpoints
from autoparallel.checkpoint.flatten import flatten
from ckpt_peers import ThreadRanks

RANKS = 4
ENOSPC = "OSError: [Errno 28] No space left on device"


def _state(step: int) -> dict:
    return {"w": np.full((2, 3), float(step), dtype=np.float32), "loader": {"index": 10 * step}}


def _loaded(path: str) -> dict:
    target = {"w": np.zeros((2, 3), dtype=np.float32), "loader": {"index": -1}}
    ap.load_state_dict(target, path)
    return target


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


# ---- the helper every rank-0-only step goes through -----------------------------------------------------
def test_a_rank_zero_step_failing_is_raised_on_every_rank_naming_rank_zero(monkeypatch):
    ranks = ThreadRanks(monkeypatch, RANKS)
    ran = []

    def step():
        ran.append(1)
        _full_disk()
    got = ranks.run(lambda r: sync.rank_zero_step("checkpoint /c: writing 'latest'", step))
    assert len(ran) == 1 and ranks.gathers == 1                 # rank 0 only, then one status exchange
    for r in range(RANKS):
        assert isinstance(got[r], CheckpointSaveError), (r, got[r])
        assert str(got[r]) == f"checkpoint /c: writing 'latest' failed on rank 0: {ENOSPC}"


def test_negative_control_a_rank_zero_step_that_succeeds_returns_on_every_rank(monkeypatch):
    ranks = ThreadRanks(monkeypatch, RANKS)
    got = ranks.run(lambda r: sync.rank_zero_step("checkpoint /c: writing 'latest'", lambda: "done"))
    assert got == {0: "done", 1: None, 2: None, 3: None} and ranks.gathers == 1


def test_a_ctrl_c_on_rank_zero_stays_a_ctrl_c_there_and_is_typed_on_the_others(monkeypatch):
    ranks = ThreadRanks(monkeypatch, RANKS)

    def step():
        raise KeyboardInterrupt()
    got = ranks.run(lambda r: sync.rank_zero_step("checkpoint /c: pruning", step))
    assert isinstance(got[0], KeyboardInterrupt)
    for r in range(1, RANKS):
        assert isinstance(got[r], CheckpointSaveError)
        assert str(got[r]) == "checkpoint /c: pruning failed on rank 0: KeyboardInterrupt: "


# ---- CheckpointManager.save: 'latest' and pruning ---------------------------------------------------------
def _first_run(root: str) -> None:
    """Step 1 saved by a one-process run (keep_last=1): the checkpoint every later failure must leave loadable."""
    m = CheckpointManager(root, save_interval_steps=1, keep_last=1)
    m.start()
    m.save(_state(1), 1)


def _started(monkeypatch, root: str):
    """Every rank's manager of the run in ``root`` (threads), started to continue it."""
    ranks = ThreadRanks(monkeypatch, RANKS)
    managers = {r: CheckpointManager(root, save_interval_steps=1, keep_last=1) for r in range(RANKS)}
    assert ranks.run(lambda r: managers[r].start(resume=True)) == {r: None for r in range(RANKS)}
    return ranks, managers


def _save_on_every_rank(monkeypatch, ranks, managers, step: int) -> dict:
    """CheckpointManager.save(step) on every rank (threads). The save itself is rank 0's one-process save (what
    a committed multi-process save leaves is the same directory); the other ranks return when it is committed."""
    real = manager_module.save_state_dict
    committed = threading.Event()

    def save(state, path, **kwargs):
        if sync.job()[1] != 0:
            assert committed.wait(ranks.JOIN_S)
            return path
        try:
            with ranks.single():
                return real(state, path, **kwargs)
        finally:
            committed.set()
    monkeypatch.setattr(manager_module, "save_state_dict", save)
    return ranks.run(lambda r: managers[r].save(_state(step), step))


def _latest(root: str) -> str:
    with open(os.path.join(root, "latest")) as f:
        return f.read()


def test_latest_failing_on_rank_zero_fails_every_rank_and_the_previous_checkpoint_still_loads(tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    _first_run(root)
    ranks, managers = _started(monkeypatch, root)
    monkeypatch.setattr(run_root_module, "write_latest", _full_disk)
    got = _save_on_every_rank(monkeypatch, ranks, managers, 2)
    for r in range(RANKS):
        assert isinstance(got[r], CheckpointSaveError), (r, got[r])
        assert str(got[r]) == (f"checkpoint {root}/step-00000002 is saved, but updating its run root after it "
                               f"(rank 0 only) failed on rank 0: OSError: [Errno 28] writing 'latest' (it still "
                               f"names the previous checkpoint; nothing was pruned): No space left on device")
    assert _latest(root) == "step-00000001\n"
    assert sorted(os.listdir(root)) == [".autoparallel-run", "latest", "step-00000001", "step-00000002"]
    old = _loaded(os.path.join(root, _latest(root).strip()))
    np.testing.assert_array_equal(old["w"], np.full((2, 3), 1.0, dtype=np.float32))
    assert old["loader"] == {"index": 10}
    monkeypatch.undo()                        # negative control: the next save prunes both older steps
    got = _save_on_every_rank(monkeypatch, *_started(monkeypatch, root), 3)
    assert got == {r: f"{root}/step-00000003" for r in range(RANKS)}
    assert sorted(os.listdir(root)) == [".autoparallel-run", "latest", "step-00000003"]
    assert _latest(root) == "step-00000003\n" and _loaded(root)["loader"] == {"index": 30}


def test_pruning_failing_on_rank_zero_fails_every_rank_and_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    _first_run(root)
    real_rename = os.rename

    def rename(src, dst):                     # the old checkpoint's directory cannot be moved (its permissions)
        if os.path.basename(str(src)) == "step-00000001":
            raise PermissionError(errno.EACCES, "Permission denied", str(src))
        return real_rename(src, dst)
    ranks, managers = _started(monkeypatch, root)
    monkeypatch.setattr(os, "rename", rename)
    got = _save_on_every_rank(monkeypatch, ranks, managers, 2)
    for r in range(RANKS):
        assert isinstance(got[r], CheckpointSaveError), (r, got[r])
        assert (f"failed on rank 0: PermissionError: [Errno 13] pruning (after 'latest' was updated): Permission "
                f"denied: '{root}/step-00000001'") in str(got[r])
    assert _latest(root) == "step-00000002\n"
    assert _loaded(root)["loader"] == {"index": 20}
    assert _loaded(os.path.join(root, "step-00000001"))["loader"] == {"index": 10}     # whole, not half removed
    assert incomplete_checkpoints(root) == []


# ---- CheckpointManager.restore: the pointer's repair ------------------------------------------------------
def test_repairing_latest_after_a_restore_failing_on_rank_zero_fails_every_rank(tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    _first_run(root)
    os.remove(os.path.join(root, "latest"))   # a crash between a commit and its pointer update
    monkeypatch.setattr(run_root_module, "write_latest", _full_disk)
    ranks = ThreadRanks(monkeypatch, RANKS)
    targets = {r: _state(0) for r in range(RANKS)}
    got = ranks.run(lambda r: CheckpointManager(root, keep_last=1).restore(targets[r]))
    for r in range(RANKS):
        assert type(got[r]) is CheckpointError, (r, got[r])
        assert str(got[r]) == (f"checkpoint {root}/step-00000001 is loaded on every rank, but repairing "
                               f"{root}/latest after it (rank 0 only) failed on rank 0: {ENOSPC}")
        assert targets[r]["loader"] == {"index": 10}
    assert not os.path.exists(os.path.join(root, "latest"))


# ---- save_state_dict: rank 0's metadata and commit ---------------------------------------------------------
def _save_multi_on_every_rank(final: str, state: dict, nonce: str) -> dict:
    """Every rank's write and rendezvous of a save replacing ``final`` (threads; save.py's file rendezvous)."""
    tensors, values, writes = collect(flatten(state), 0, False)
    meta = {"format": "autoparallel.checkpoint", "version": 1, "step": 2, "extra": None, "nonce": nonce,
            "world_size": RANKS, "created": 0.0, "tensors": tensors, "values": values, "files": {}}
    tmp = save_module.temp_dir_for(final, nonce)
    os.makedirs(tmp)
    got = {}

    def rank(r):
        try:
            save_module._save_multi(copy.deepcopy(meta), tmp, final, True, r, RANKS, writes.get(r, []), 1 << 20)
            got[r] = None
        except Exception as e:
            got[r] = e
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def test_the_metadata_write_failing_on_rank_zero_is_typed_on_every_rank_and_keeps_the_old_checkpoint(
        tmp_path, monkeypatch):
    final = str(tmp_path / "ck")
    ap.save_state_dict(_state(1), final)
    monkeypatch.setenv("AP_CKPT_FAULT", "before_metadata_rename:enospc")     # rank 0's full disk at its metadata
    got = _save_multi_on_every_rank(final, _state(2), "0123456789ab")
    cause = f"{ENOSPC} (injected at before_metadata_rename)"
    assert isinstance(got[0], CheckpointSaveError), got[0]
    assert str(got[0]) == f"checkpoint {final}: rank 0 could not commit: {cause}; nothing was committed"
    for r in range(1, RANKS):
        assert isinstance(got[r], CheckpointSaveError), (r, got[r])
        assert str(got[r]) == f"checkpoint {final}: rank 0 could not commit: {cause}"
    assert sorted(os.listdir(tmp_path)) == ["ck"]           # no temporary directory left
    assert _loaded(final)["loader"] == {"index": 10}
    monkeypatch.delenv("AP_CKPT_FAULT")                     # negative control: the same save commits
    assert _save_multi_on_every_rank(final, _state(2), "0123456789ac") == {r: None for r in range(RANKS)}
    assert _loaded(final)["loader"] == {"index": 20}


# ---- load_state_dict: a failure on some ranks only ---------------------------------------------------------
def _load_on_every_rank(monkeypatch, path: str, targets: dict) -> dict:
    """ap.load_state_dict(targets[r], path) on every rank (threads), the state taken as spread over the ranks."""
    import autoparallel.checkpoint.load as load_module

    ranks = ThreadRanks(monkeypatch, RANKS)
    monkeypatch.setattr(load_module, "_every_rank_loads", lambda flat: True)
    return ranks.run(lambda r: ap.load_state_dict(targets[r], path))


def test_a_load_failing_on_rank_one_only_fails_every_rank_with_nothing_loaded(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    ap.save_state_dict(_state(1), path)
    targets = {r: {"w": np.zeros((2, 3), dtype=np.float32), "loader": {"index": -1}} for r in range(RANKS)}
    targets[1]["w"] = np.zeros((3, 2), dtype=np.float32)        # rank 1's own state does not match the checkpoint
    got = _load_on_every_rank(monkeypatch, path, targets)
    assert type(got[1]) is CheckpointMismatchError and "'w'" in str(got[1])
    for r in (0, 2, 3):                                         # rank 1's error, typed as there, prefixed
        assert type(got[r]) is CheckpointMismatchError, (r, got[r])
        assert str(got[r]) == f"(rank 1) {got[1]}"
    for r in range(RANKS):                                      # nothing assigned anywhere
        assert not targets[r]["w"].any() and targets[r]["loader"] == {"index": -1}


def test_a_ctrl_c_in_rank_ones_read_stays_a_ctrl_c_there_and_fails_the_others(tmp_path, monkeypatch):
    import autoparallel.checkpoint.load as load_module

    path = str(tmp_path / "ck")
    ap.save_state_dict(_state(1), path)
    real_fill = load_module._fill

    def fill(*args):
        if sync.job()[1] == 1:
            raise KeyboardInterrupt()
        return real_fill(*args)
    monkeypatch.setattr(load_module, "_fill", fill)
    targets = {r: {"w": np.zeros((2, 3), dtype=np.float32), "loader": {"index": -1}} for r in range(RANKS)}
    got = _load_on_every_rank(monkeypatch, path, targets)
    assert isinstance(got[1], KeyboardInterrupt)
    for r in (0, 2, 3):
        assert type(got[r]) is CheckpointError, (r, got[r])
        assert str(got[r]) == (f"(rank 1) checkpoint {path}: the load failed there: KeyboardInterrupt: ; nothing "
                               f"was loaded on any rank")
        assert not targets[r]["w"].any()
    monkeypatch.setattr(load_module, "_fill", real_fill)        # negative control: every rank loads
    got = _load_on_every_rank(monkeypatch, path, targets)
    for r in range(RANKS):
        assert got[r].step is None and targets[r]["loader"] == {"index": 10}
        np.testing.assert_array_equal(targets[r]["w"], np.full((2, 3), 1.0, dtype=np.float32))


def test_a_peer_gone_from_the_loads_exchange_is_a_typed_error(tmp_path, monkeypatch):
    import autoparallel.checkpoint.load as load_module
    from ckpt_peers import fake_peer

    path = str(tmp_path / "ck")
    ap.save_state_dict(_state(1), path)

    def gone(t, call):
        raise RuntimeError("[gloo] Connection closed by peer")
    fake_peer(monkeypatch, gone)
    monkeypatch.setattr(load_module, "_every_rank_loads", lambda flat: True)
    target = {"w": np.zeros((2, 3), dtype=np.float32), "loader": {"index": -1}}
    with pytest.raises(CheckpointError, match=r"the ranks did not finish the load together .*: \[gloo\] Connection "
                                              r"closed by peer"):
        ap.load_state_dict(target, path)
    assert not target["w"].any()


def test_which_loads_every_rank_makes_together(monkeypatch):
    import paddle

    import autoparallel.checkpoint.load as load_module
    from autoparallel.checkpoint.flatten import flatten as flat_of

    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], ["dp"])
        spread = {"w": ap.shard_tensor(paddle.zeros([4, 2]), mesh, [ap.Shard(0)])}
        alone = {"w": ap.shard_tensor(paddle.zeros([4, 2]), ap.ProcessMesh([0], ["dp"]), [ap.Replicate()])}
        assert load_module._every_rank_loads(flat_of(spread)) is False        # one process: nothing to share
        monkeypatch.setattr(sync, "job", lambda: (True, 0, 2))
        assert load_module._every_rank_loads(flat_of(spread)) is True
        assert load_module._every_rank_loads(flat_of(dict(spread, b=alone["w"]))) is True
        assert load_module._every_rank_loads(flat_of(alone)) is False         # a part of the job: no exchange
        assert load_module._every_rank_loads(flat_of(_state(1))) is False     # rank 0 alone may load plain state
        monkeypatch.setattr(sync, "job", lambda: (True, 0, 4))                 # ranks 0-1 of 4 may load alone
        assert load_module._every_rank_loads(flat_of(spread)) is False


# ---- CheckpointManager.start / restore: anything raised on one rank -------------------------------------------
def test_a_ctrl_c_on_rank_one_during_a_restore_fails_every_rank(tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    _first_run(root)
    real = manager_module.runtime_state.restore

    def restore(*args):
        if sync.job()[1] == 1:
            raise KeyboardInterrupt()
        return real(*args)
    monkeypatch.setattr(manager_module.runtime_state, "restore", restore)
    ranks = ThreadRanks(monkeypatch, RANKS)
    got = ranks.run(lambda r: CheckpointManager(root).restore(_state(0)))
    assert isinstance(got[1], KeyboardInterrupt)
    for r in (0, 2, 3):                         # before: they waited in the agreement for rank 1
        assert type(got[r]) is CheckpointError and str(got[r]) == "(rank 1) KeyboardInterrupt: ", (r, got[r])


def test_an_unexpected_error_in_rank_zeros_claim_fails_every_rank(tmp_path, monkeypatch):
    def claim(root, resume):
        raise RuntimeError("input/output error on the run marker")
    monkeypatch.setattr(run_root_module, "claim", claim)
    ranks = ThreadRanks(monkeypatch, RANKS)
    got = ranks.run(lambda r: CheckpointManager(str(tmp_path / "run")).start())
    assert type(got[0]) is RuntimeError
    for r in range(1, RANKS):
        assert type(got[r]) is CheckpointError, (r, got[r])
        assert str(got[r]) == "(rank 0) RuntimeError: input/output error on the run marker"


# ---- save_state_dict: anything raised on one rank before the opening exchange --------------------------------
def test_a_ctrl_c_before_the_saves_exchange_travels_in_it(monkeypatch):
    import json

    import paddle

    from autoparallel.checkpoint.save_agree import agree
    from ckpt_peers import fake_peer

    sent = fake_peer(monkeypatch, lambda t, call: t)          # rank 0, interrupted before the exchange
    with pytest.raises(KeyboardInterrupt):
        agree({}, "0123456789ab", "/ckpt", problem=KeyboardInterrupt())
    mine = json.loads(sent[1].numpy().tobytes())
    assert mine["error"] == ["KeyboardInterrupt", ""]          # what rank 1 receives
    peer = json.dumps(dict(mine, token="ba9876543210")).encode()

    def answer(t, call):                                       # rank 1, receiving rank 0's interrupt
        if call == 1:
            return paddle.to_tensor([len(peer)], dtype="int64")
        buf = np.zeros(t.shape[0], dtype=np.uint8)
        buf[:len(peer)] = np.frombuffer(peer, dtype=np.uint8)
        return paddle.to_tensor(buf)
    monkeypatch.undo()
    fake_peer(monkeypatch, answer, rank=1)
    with pytest.raises(CheckpointSaveError) as e:
        agree({}, "0123456789ab", "/ckpt")
    assert str(e.value) == "(rank 0) KeyboardInterrupt: "


def test_save_state_dict_hands_a_ctrl_c_in_its_checks_to_the_exchange(tmp_path, monkeypatch):
    seen = []

    def checked(*args):
        raise KeyboardInterrupt()

    def agree(flat, token, final, problem=None, probe=None):
        seen.append(type(problem).__name__)
        raise problem
    monkeypatch.setattr(save_module, "_checked", checked)
    monkeypatch.setattr(save_module.save_agree, "agree", agree)
    with pytest.raises(KeyboardInterrupt):
        ap.save_state_dict(_state(1), str(tmp_path / "ck"))
    assert seen == ["KeyboardInterrupt"] and os.listdir(tmp_path) == []


def test_a_peer_gone_from_a_rank_zero_steps_exchange_is_a_typed_error(monkeypatch):
    from ckpt_peers import fake_peer

    def gone(t, call):
        raise RuntimeError("[gloo] Connection closed by peer")
    fake_peer(monkeypatch, gone, rank=1)
    with pytest.raises(CheckpointSaveError) as e:
        sync.rank_zero_step("checkpoint /c: writing 'latest'", lambda: None)
    assert str(e.value) == ("checkpoint /c: writing 'latest': a rank did not take part in sharing its outcome (it "
                            "left the save or restore before it): [gloo] Connection closed by peer")
