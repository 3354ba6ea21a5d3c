"""Loading what a crash or another tool left: an overwrite killed between its two renames still loads as the
checkpoint it was replacing (plain path and a manager's resume, before any start-up has put it back), and a
directory of paddle.distributed.save_state_dict is named as such (its pickled metadata is never loaded), with
the conversion both ways giving the same values."""
import os

import numpy as np
import paddle
import paddle.distributed as dist
import pytest

import autoparallel as ap
from autoparallel.checkpoint import CheckpointCorruptError, CheckpointManager, load_state_dict, save_state_dict


def _w(value):
    return {"w": paddle.full([4], value)}


def test_an_overwrite_killed_between_its_renames_still_loads_the_old_checkpoint(tmp_path):
    path = str(tmp_path / "plain")
    save_state_dict(_w(1.0), path)
    os.rename(path, path + ".tmp-old-0123456789ab")          # the overwrite's first rename, then the kill
    target = _w(0.0)
    load_state_dict(target, path)
    assert target["w"].numpy().tolist() == [1.0] * 4
    os.rename(path + ".tmp-old-0123456789ab", path + ".tmp-0123456789ab")   # negative control: uncommitted
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_state_dict(_w(0.0), path)


def test_resume_after_an_interrupted_overwrite_continues_from_its_step(tmp_path):
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, save_interval_steps=1)
    mgr.save(_w(1.0), 1)
    mgr.save(_w(2.0), 2)
    os.rename(os.path.join(root, "step-00000002"), os.path.join(root, "step-00000002.tmp-old-0123456789ab"))
    target = _w(0.0)
    info = CheckpointManager(root).restore(target)             # resume_from_last_checkpoint's path: no start()
    assert info.step == 2 and target["w"].numpy().tolist() == [2.0] * 4
    again = CheckpointManager(root, save_interval_steps=1)
    again.start(_w(0.0), resume=True)                            # start-up puts it back; latest names it
    assert sorted(os.listdir(root)) == [".autoparallel-run", "latest", "step-00000001", "step-00000002"]
    assert open(os.path.join(root, "latest")).read().strip() == "step-00000002"


def test_a_paddle_checkpoint_is_named_and_converts_both_ways(tmp_path):
    paddle.seed(3)
    model = paddle.nn.Linear(3, 2)
    want = {k: v.numpy() for k, v in model.state_dict().items()}
    dist.save_state_dict(model.state_dict(), str(tmp_path / "paddle"))

    def zeros():
        return {k: paddle.zeros(v.shape, v.dtype) for k, v in model.state_dict().items()}
    with pytest.raises(FileNotFoundError, match=r"paddle.distributed.save_state_dict's format .*never loads"):
        load_state_dict(zeros(), str(tmp_path / "paddle"))
    state = zeros()
    dist.load_state_dict(state, str(tmp_path / "paddle"))      # the conversion the message describes
    save_state_dict(state, str(tmp_path / "ours"))
    back = zeros()
    load_state_dict(back, str(tmp_path / "ours"))
    merged = ap.load_merged_state_dict(str(tmp_path / "ours"))
    dist.save_state_dict({k: paddle.to_tensor(v) for k, v in merged.items()}, str(tmp_path / "again"))
    again = zeros()
    dist.load_state_dict(again, str(tmp_path / "again"))
    for k in want:
        np.testing.assert_array_equal(back[k].numpy(), want[k])
        np.testing.assert_array_equal(again[k].numpy(), want[k])


def test_a_corrupt_newest_checkpoint_names_the_way_back_and_loads_nothing(tmp_path):
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, save_interval_steps=1)
    mgr.save(_w(1.0), 1)
    mgr.save(_w(2.0), 2)
    data = os.path.join(root, "step-00000002", "data-r00000.bin")
    os.truncate(data, 4)
    target = _w(0.0)
    with pytest.raises(CheckpointCorruptError, match=r"truncated or overwritten\). The newest older complete "
                                                        r"checkpoint is step-00000001: move step-00000002 out"):
        CheckpointManager(root).restore(target)
    assert target["w"].numpy().tolist() == [0.0] * 4
    os.rename(os.path.join(root, "step-00000002"), str(tmp_path / "broken"))      # what the message says
    assert CheckpointManager(root).restore(target).step == 1 and target["w"].numpy().tolist() == [1.0] * 4
