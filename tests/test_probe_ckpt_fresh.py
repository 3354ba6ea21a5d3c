"""In one process: the parts of the one-directory check (shared_dir.py) with a peer played by a fake all_gather
(the same on 2 real ranks: tests/test_probe_ckpt_fresh_dist.py), a non-zero rank's rendezvous timeout typed like
rank 0's, a Ctrl-C inside a simulated save (in a rank's write and between the two renames of an overwrite)
keeping the checkpoint it was replacing, a checkpoint of another format version refused naming its file, one
flipped bit in metadata.json refused by its own checksum (it loaded a wrong tensor), and run state a restore
leaves out (the loss scale, the generators) named in a warning."""
import copy
import json
import os
import shutil
import threading

import numpy as np
import paddle
import pytest

import autoparallel as ap
import autoparallel.checkpoint.atomic as atomic_module
import autoparallel.checkpoint.save as save_module
from autoparallel.checkpoint import (CheckpointCorruptError, CheckpointSaveError, load_merged_state_dict,
                                     read_checkpoint_info)
from autoparallel.checkpoint import shared_dir
from autoparallel.checkpoint.collect import collect
from autoparallel.checkpoint.flatten import flatten
from ckpt_peers import fake_peer

W = np.arange(32, dtype=np.float32).reshape(8, 4)          # the saved value: 0, 1, ..., 31


def test_path_difference_names_every_ranks_path():
    assert shared_dir.path_difference(["/a/ck", "/a/ck", "/a/ck"]) == ""
    assert shared_dir.path_difference(["/n0/ck", "/n1/ck"]) == (
        " The ranks' paths differ (rank 0: /n0/ck, rank 1: /n1/ck): a relative path is resolved in each rank's "
        "working directory.")


def test_unseen_waits_for_a_late_probe_and_names_a_missing_one(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_dir, "VISIBLE_WAIT_S", 1.0)
    probes = [str(tmp_path / f"p{r}") for r in range(3)]
    open(probes[1], "w").close()                              # rank 0's own (probes[0]) is never looked for
    assert shared_dir.unseen(probes, 0) == [2]
    late = threading.Timer(0.3, lambda: open(probes[2], "w").close())
    late.start()
    assert shared_dir.unseen(probes, 0) == []                 # a probe shown late (a shared filesystem) is seen
    late.join()


def test_check_visible_stops_every_rank_naming_who_cannot_see_whom(tmp_path, monkeypatch):
    mine = shared_dir.leave_probe(str(tmp_path / "ck"), "0123456789ab", 0)
    assert os.path.basename(mine) == ".autoparallel-probe-0123456789ab-r00000"
    probes = [mine, str(tmp_path / ".autoparallel-probe-ba9876543210-r00001")]
    open(probes[1], "w").close()
    fake_peer(monkeypatch, lambda t, call: paddle.to_tensor(np.array([1, 0], dtype=np.int32)))   # blind to 0
    with pytest.raises(CheckpointSaveError, match=r"^checkpoint /x: '.*' is not one directory every rank sees: "
                                                  r"rank 1 does not see the files of ranks \[0\]\. A multi-process"):
        shared_dir.check_visible(probes, "checkpoint /x", 0, 2)
    fake_peer(monkeypatch, lambda t, call: t)                # negative control: the peer sees rank 0's probe
    shared_dir.check_visible(probes, "checkpoint /x", 0, 2)
    shared_dir.remove_probe(mine)
    assert not os.path.exists(mine)


def _peer_answers(monkeypatch, peer: dict, flags):
    """This process as rank 0 of 2; the peer answers the exchange with ``peer`` (its length, then its bytes) and
    the probe check with ``flags`` (the ranks whose probe it cannot see)."""
    raw = np.frombuffer(json.dumps(peer).encode(), dtype=np.uint8)

    def answer(t, call):
        if call == 1:
            return paddle.to_tensor([raw.size], dtype="int64")
        if call == 2:
            buf = np.zeros(t.shape[0], dtype=np.uint8)
            buf[:raw.size] = raw
            return paddle.to_tensor(buf)
        return paddle.to_tensor(np.array(flags, dtype=np.int32))
    return fake_peer(monkeypatch, answer)


def test_agree_refuses_a_peer_writing_elsewhere_naming_both_paths(tmp_path, monkeypatch):
    """The peer's absolute path differs (a relative path under another working directory) and neither rank sees
    the other's probe: every rank raises after the probe check, naming both paths."""
    from autoparallel.checkpoint.save_agree import agree

    monkeypatch.setattr(shared_dir, "VISIBLE_WAIT_S", 0.2)
    (tmp_path / "node0").mkdir()
    mine, theirs = str(tmp_path / "node0" / "ck"), str(tmp_path / "node1" / "ck")
    probe = shared_dir.leave_probe(mine, "0123456789ab", 0)
    peer = {"token": "ffffffffffff", "reduce": [], "error": None, "final": theirs,
            "probe": shared_dir.probe_path(theirs, "ffffffffffff", 1)}       # in a directory rank 0 does not see
    calls = _peer_answers(monkeypatch, peer, [1, 0])
    with pytest.raises(CheckpointSaveError) as err:
        agree({}, "0123456789ab", mine, None, probe)
    assert str(err.value).startswith(f"checkpoint {mine}: {str(tmp_path / 'node0')!r} is not one directory every "
                                     f"rank sees: rank 0 does not see the files of ranks [1]; rank 1 does not see "
                                     f"the files of ranks [0]. The ranks' paths differ (rank 0: {mine}, rank 1: "
                                     f"{theirs})"), err.value
    assert len(calls) == 3                     # the exchange's two all_gathers, then the probe check's one


def test_negative_control_two_paths_to_one_directory_pass(tmp_path, monkeypatch):
    """Two mount points of one shared directory (played by a symlink): the paths differ, every probe is seen,
    and the save goes on with rank 0's token (the rendezvous works there, so the check must not refuse it)."""
    from autoparallel.checkpoint.save_agree import agree

    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "mount")
    mine, theirs = str(tmp_path / "real" / "ck"), str(tmp_path / "mount" / "ck")
    probe = shared_dir.leave_probe(mine, "0123456789ab", 0)
    peer_probe = shared_dir.leave_probe(theirs, "ffffffffffff", 1)
    _peer_answers(monkeypatch, {"token": "ffffffffffff", "reduce": [], "error": None, "final": theirs,
                                "probe": peer_probe}, [0, 0])
    assert agree({}, "0123456789ab", mine, None, probe) == "0123456789ab"


def test_a_non_zero_ranks_rendezvous_timeout_is_a_typed_error(tmp_path, monkeypatch):
    """Rank 1 of 2 writes its part, then rank 0 never commits: CheckpointSaveError naming rank 1 (it was a bare
    TimeoutError, where rank 0's own timeout was a CheckpointSaveError)."""
    monkeypatch.setenv("AP_CKPT_TIMEOUT", "1")
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], ["dp"])
        state = {"w": ap.shard_tensor(paddle.to_tensor(W), mesh, [ap.Shard(0)])}
        tensors, values, writes = collect(flatten(state), 0, False)
    meta = {"format": "autoparallel.checkpoint", "version": 1, "step": 1, "extra": None, "nonce": "0123456789ab",
            "world_size": 2, "created": 0.0, "tensors": tensors, "values": values, "files": {}}
    final = str(tmp_path / "ck")
    tmp = save_module.temp_dir_for(final, "0123456789ab")
    os.makedirs(tmp)
    with pytest.raises(CheckpointSaveError, match=r"^\(rank 1\) checkpoint .*ck: rank 0 did not commit within 1 s"):
        save_module._save_multi(copy.deepcopy(meta), tmp, final, False, 1, 2, writes[1], 1 << 20)


def _saved(tmp_path):
    """A 4-rank (dp 2 x tp 2) checkpoint of W at step 1 in ``tmp_path/ck``; (path, mesh)."""
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"])
    path = str(tmp_path / "ck")
    ap.save_state_dict({"w": ap.shard_tensor(paddle.to_tensor(W), mesh, [ap.Shard(0), ap.Shard(1)])}, path, step=1)
    return path, mesh


def _assert_step_1_intact(tmp_path, path):
    assert sorted(os.listdir(tmp_path)) == ["ck"]                     # no temporary or moved-aside directory
    assert read_checkpoint_info(path).step == 1
    np.testing.assert_array_equal(load_merged_state_dict(path)["w"], W)


def test_a_ctrl_c_in_one_ranks_write_keeps_the_checkpoint_being_replaced(tmp_path, monkeypatch):
    original = save_module.write_rank_file

    def interrupted(directory, rank, items, block_bytes):
        if rank == 2:
            raise KeyboardInterrupt()
        return original(directory, rank, items, block_bytes)
    with ap.simulate(world_size=4):
        path, mesh = _saved(tmp_path)
        monkeypatch.setattr(save_module, "write_rank_file", interrupted)
        with pytest.raises(KeyboardInterrupt):
            ap.save_state_dict({"w": ap.shard_tensor(paddle.full([8, 4], 7.0), mesh, [ap.Shard(0), ap.Shard(1)])},
                               path, step=2, overwrite=True)
    _assert_step_1_intact(tmp_path, path)


def test_a_ctrl_c_between_the_renames_of_an_overwrite_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    """publish_dir moves the old checkpoint aside, then renames the new one into place: a KeyboardInterrupt at the
    second rename puts the old one back under its name."""
    real_rename = os.rename
    renames = []

    def rename(a, b):
        renames.append((os.path.basename(a), os.path.basename(b)))
        if len(renames) == 2:
            raise KeyboardInterrupt()
        return real_rename(a, b)
    with ap.simulate(world_size=4):
        path, mesh = _saved(tmp_path)
        monkeypatch.setattr(atomic_module.os, "rename", rename)
        with pytest.raises(KeyboardInterrupt):
            ap.save_state_dict({"w": ap.shard_tensor(paddle.full([8, 4], 7.0), mesh, [ap.Shard(0), ap.Shard(1)])},
                               path, step=2, overwrite=True)
        monkeypatch.setattr(atomic_module.os, "rename", real_rename)
    assert renames[0][0] == "ck" and renames[0][1].startswith("ck.tmp-old-")      # the old one moved aside
    assert renames[1][0].startswith("ck.tmp-") and renames[1][1] == "ck"         # the interrupted rename
    assert renames[2] == (renames[0][1], "ck")                                     # and put back
    _assert_step_1_intact(tmp_path, path)


def test_a_checkpoint_of_another_format_version_names_its_file_and_loads_nothing(tmp_path):
    with ap.simulate(world_size=4):
        path, mesh = _saved(tmp_path)
        other = str(tmp_path / "v2")
        shutil.copytree(path, other)
        meta_path = os.path.join(other, "metadata.json")
        with open(meta_path) as f:
            meta = json.load(f)
        meta["version"] = 2
        with open(meta_path, "w") as f:
            json.dump(meta, f)
        target = {"w": ap.shard_tensor(paddle.full([8, 4], 5.0), mesh, [ap.Shard(0), ap.Shard(1)])}
        with pytest.raises(CheckpointCorruptError, match=f"^{meta_path}: checkpoint format version 2 is not "
                                                         f"supported \\(this version reads 1\\)"):
            ap.load_state_dict(target, other)
        assert float(target["w"].full().numpy().max()) == 5.0 and float(target["w"].full().numpy().min()) == 5.0


def _flip_one_bit(path: str, pattern: bytes, index: int = 0) -> tuple:
    """Flip the lowest bit of the first byte of group ``index`` of ``pattern``'s first match in ``path``'s
    metadata.json (the ASCII digit "0" becomes "1", "2" becomes "3"); (old byte, new byte)."""
    import re

    meta_path = os.path.join(path, "metadata.json")
    with open(meta_path, "rb") as f:
        data = bytearray(f.read())
    at = re.search(pattern, bytes(data)).start(index + 1)
    old = data[at]
    data[at] ^= 1
    with open(meta_path, "wb") as f:
        f.write(bytes(data))
    return chr(old), chr(data[at])


@pytest.mark.parametrize("what, pattern", [
    ("a shard's row offset", rb'"offsets": \[\s*(0),'),       # the first shard said rows 1..4 for rows 0..3
    ("a JSON value", rb'"loader/index": 64(0)'),
    ("the step", rb'"step": (2)'),
    ("the checksum's own name", rb'"metadata_crc3(2)"'),
])
def test_one_flipped_bit_in_the_metadata_is_refused_and_loads_nothing(tmp_path, what, pattern):
    """Before the metadata's own checksum, a flipped bit in a shard's offsets loaded a wrong tensor without an
    error (measured: rows [0 0 0 0], [0 1 2 3], [4 5 6 7], [8 9 10 11], [16 ...]: the first shard written at rows
    1..4, row 0 left zero, the values 12..15 lost), and one in a value or the step changed it unseen."""
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], ["dp"])
        path = str(tmp_path / "ck")
        ap.save_state_dict({"w": ap.shard_tensor(paddle.to_tensor(W), mesh, [ap.Shard(0)]),
                            "loader": {"index": 640}}, path, step=2)
        np.testing.assert_array_equal(load_merged_state_dict(path)["w"], W)      # negative control: intact
        old, new = _flip_one_bit(path, pattern)
        assert (old, new) in (("0", "1"), ("2", "3"))
        target = {"w": ap.shard_tensor(paddle.full([8, 4], 5.0), mesh, [ap.Replicate()]), "loader": {"index": 0}}
        with pytest.raises(CheckpointCorruptError, match=f"^{path}/metadata.json: "):
            ap.load_state_dict(target, path)
        assert float(target["w"].full().numpy().min()) == 5.0 == float(target["w"].full().numpy().max())
        assert target["loader"] == {"index": 0}
        with pytest.raises(CheckpointCorruptError, match="was modified after it was written"):
            load_merged_state_dict(path)


def test_a_checkpoint_written_before_the_metadata_checksum_still_loads(tmp_path):
    """Negative control of the checksum's absence: a metadata.json holding only the fields of the format
    (format.FIELDS) loads as before; one more unknown field without the checksum is refused."""
    from autoparallel.checkpoint.format import METADATA_CRC

    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], ["dp"])
        path = str(tmp_path / "ck")
        ap.save_state_dict({"w": ap.shard_tensor(paddle.to_tensor(W), mesh, [ap.Shard(0)])}, path, step=2)
    meta_path = os.path.join(path, "metadata.json")
    with open(meta_path) as f:
        meta = json.load(f)
    assert isinstance(meta.pop(METADATA_CRC), int)
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    np.testing.assert_array_equal(load_merged_state_dict(path)["w"], W)
    meta["metadata_crc33"] = 0
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    with pytest.raises(CheckpointCorruptError, match=r"unknown checkpoint metadata fields \['metadata_crc33'\]"):
        load_merged_state_dict(path)


def _amp_run(scale=None):
    """A Linear and its AdamW, under a LossScaler of ``scale`` (None: no AMP); (state, optimizer)."""
    from autoparallel.checkpoint.state import training_state
    from autoparallel.parallel.amp import AmpOptimizer, LossScaler

    paddle.seed(0)
    model = paddle.nn.Linear(4, 3)
    opt = paddle.optimizer.AdamW(0.1, parameters=model.parameters())
    if scale is not None:
        opt = AmpOptimizer(opt, LossScaler(scale))
    return training_state(model, opt), opt


def _restore_warnings(root, scale):
    """Restore ``root``'s newest checkpoint into a fresh run under ``scale``; (info, the RuntimeWarning texts)."""
    import warnings

    from autoparallel.checkpoint import CheckpointManager

    state, opt = _amp_run(scale)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = CheckpointManager(root, 1, optimizer=opt).restore(state)
    return info, opt, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_a_loss_scale_left_out_of_a_restore_is_reported(tmp_path):
    """The manager restored the loss scale only when both the checkpoint and the resuming optimizer had one, and
    said nothing otherwise (only ``info.restored`` lacked "amp"): a run resumed without AMP dropped the saved
    scale 256.0, one resumed with AMP from a checkpoint without it started again from its initial 1024.0."""
    from autoparallel.checkpoint import CheckpointManager

    state, opt = _amp_run(1024.0)
    opt.scaler.scale_value = 256.0
    CheckpointManager(str(tmp_path / "amp"), 1, optimizer=opt).save(state, 1)
    state, opt = _amp_run(None)
    CheckpointManager(str(tmp_path / "plain"), 1, optimizer=opt).save(state, 1)

    info, _, said = _restore_warnings(str(tmp_path / "amp"), None)
    assert "amp" not in info.restored and len(said) == 1, said
    assert said[0] == ("the checkpoint's run state was not all restored: the loss scale 256.0 (the optimizer given "
                       "has no loss scaler: not under AMP)")
    info, opt, said = _restore_warnings(str(tmp_path / "plain"), 1024.0)
    assert "amp" not in info.restored and opt.scaler.scale_value == 1024.0
    assert said == ["the checkpoint's run state was not all restored: the loss scale (the checkpoint holds none: "
                    "the optimizer's loss scaler keeps scale 1024.0)"]
    info, opt, said = _restore_warnings(str(tmp_path / "amp"), 1024.0)     # negative control: both under AMP
    assert "amp" in info.restored and opt.scaler.scale_value == 256.0 and said == []


def test_generators_left_as_seeded_under_another_world_size_are_reported(tmp_path):
    from autoparallel.checkpoint import CheckpointManager

    state, opt = _amp_run(None)
    with ap.simulate(world_size=2):
        CheckpointManager(str(tmp_path), 1, optimizer=opt).save(state, 1)
    info, _, said = _restore_warnings(str(tmp_path), None)
    assert "rng" not in info.restored
    assert said == ["the checkpoint's run state was not all restored: the random generators (saved by 2 ranks, "
                    "this job has 1: they stay as seeded)"]


def test_a_rank_other_than_0_looks_for_rank_0s_probe_only(tmp_path, monkeypatch):
    """2 x (ranks - 1) lookups per save on a shared filesystem, not ranks^2: rank 2 of 4 reports rank 0's
    missing probe and does not look for ranks 1 and 3 (theirs are missing too)."""
    monkeypatch.setattr(shared_dir, "VISIBLE_WAIT_S", 0.2)
    probes = [str(tmp_path / f"p{r}") for r in range(4)]
    assert shared_dir.unseen(probes, 2) == [0]
    assert shared_dir.unseen(probes, 0) == [1, 2, 3]
    open(probes[0], "w").close()
    assert shared_dir.unseen(probes, 2) == []


def test_a_probe_is_looked_for_in_this_ranks_directory_not_at_its_path(tmp_path, monkeypatch):
    """Two working directories on one filesystem (a relative path): rank 1's probe exists at its own absolute path,
    which rank 0 can open, but not in rank 0's directory; looked for at its path, it passed and the save then
    waited in the rendezvous (a first version of this check: 199 s, until the job's deadline)."""
    monkeypatch.setattr(shared_dir, "VISIBLE_WAIT_S", 0.2)
    (tmp_path / "node0").mkdir()
    (tmp_path / "node1").mkdir()
    probes = [shared_dir.leave_probe(str(tmp_path / f"node{r}" / "ck"), f"{r:012x}", r) for r in range(2)]
    assert all(os.path.exists(p) for p in probes)
    assert shared_dir.unseen(probes, 0) == [1] and shared_dir.unseen(probes, 1) == [0]


def test_the_metadata_checksum_is_taken_over_what_a_reader_parses(tmp_path):
    """Keys that are not strings sort differently before and after JSON (2 < 10, "10" < "2"), and tuples become
    lists: the checksum is taken over the parsed form, so a reader computes the same one."""
    from autoparallel.checkpoint.format import check_metadata_crc, encode_metadata

    meta = {"format": "autoparallel.checkpoint", "version": 1, "runtime": {"by_step": {2: "a", 10: (1, 2)}}}
    parsed = json.loads(encode_metadata(meta))
    assert parsed["runtime"] == {"by_step": {"2": "a", "10": [1, 2]}}
    check_metadata_crc(parsed, "m.json")                  # no CheckpointCorruptError
    parsed["runtime"]["by_step"]["2"] = "b"
    with pytest.raises(CheckpointCorruptError, match=r"^m\.json: metadata checksum mismatch"):
        check_metadata_crc(parsed, "m.json")


def test_a_probe_that_cannot_be_created_is_a_typed_error_naming_the_rank_and_directory(tmp_path):
    """What the exchange then raises on every rank (the others prefixed with this rank), before any write."""
    missing = str(tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match=f"cannot save checkpoint '{missing}/ck': rank 3 cannot create a "
                                                f"file in '{missing}': No such file or directory"):
        shared_dir.leave_probe(os.path.join(missing, "ck"), "0123456789ab", 3)


def _scheduled_run(scheduled: bool):
    """A Linear and its AdamW over StepDecay(0.1, step_size=2, gamma=0.5) stepped 3 times (lr 0.05), or over a
    constant 0.1; (model, optimizer)."""
    paddle.seed(0)
    model = paddle.nn.Linear(4, 3)
    lr = paddle.optimizer.lr.StepDecay(0.1, step_size=2, gamma=0.5) if scheduled else 0.1
    opt = paddle.optimizer.AdamW(lr, parameters=model.parameters())
    for _ in range(3 if scheduled else 0):
        lr.step()
    return model, opt


def _restore_into(root, scheduled: bool, training: bool = False):
    import warnings

    from autoparallel.checkpoint import CheckpointManager
    from autoparallel.checkpoint.state import training_state

    model, opt = _scheduled_run(scheduled)         # a plain dict of the parameters, or ap.training_state
    state = training_state(model, opt) if training else {"model": dict(model.named_parameters())}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = CheckpointManager(root, 1, optimizer=opt).restore(state)
    return info, opt, [(w.category.__name__, str(w.message)) for w in caught]


def test_an_lr_schedule_left_out_of_a_restore_is_reported_once(tmp_path):
    """The manager restored the schedule only when both sides had one and, with a plain dict state, said nothing
    otherwise: a run resumed over a constant learning rate dropped a decayed schedule (lr 0.05 -> 0.1)."""
    from autoparallel.checkpoint import CheckpointManager

    from autoparallel.checkpoint.state import training_state

    for scheduled in (True, False):
        model, opt = _scheduled_run(scheduled)
        CheckpointManager(str(tmp_path / str(scheduled)), 1, optimizer=opt).save(
            {"model": dict(model.named_parameters())}, 1)
    model, opt = _scheduled_run(False)
    CheckpointManager(str(tmp_path / "training"), 1, optimizer=opt).save(training_state(model, opt), 1)
    info, opt, said = _restore_into(str(tmp_path / "True"), scheduled=False)
    assert "lr_scheduler" not in info.restored and opt.get_lr() == 0.1
    assert said == [("RuntimeWarning", "the checkpoint's run state was not all restored: the LR schedule "
                                       "(last_epoch 3; the optimizer given has no LR scheduler: its learning "
                                       "rate stays as built)")]
    _, _, said = _restore_into(str(tmp_path / "False"), scheduled=True)
    assert said == [("RuntimeWarning", "the checkpoint's run state was not all restored: the LR schedule (the "
                                       "checkpoint holds none: the optimizer's StepDecay keeps last_epoch 3)")]
    _, _, said = _restore_into(str(tmp_path / "training"), scheduled=True, training=True)   # the load's warning,
    assert [c for c, _ in said] == ["UserWarning"] and "holds no LR schedule" in said[0][1]   # not a second one
    info, opt, said = _restore_into(str(tmp_path / "True"), scheduled=True)   # negative control: both scheduled
    assert "lr_scheduler" in info.restored and said == [] and opt.get_lr() == 0.05
