"""Distributed checkpoints in the simulated world: save under one layout, load under others, compare with
the full tensors; replicas written once; partial reads; typed errors with nothing overwritten."""
import json
import os

import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.checkpoint import (CheckpointCorruptError, CheckpointMismatchError, load_merged_state_dict,
                                     load_state_dict, read_checkpoint_info, save_state_dict, verify_checkpoint)
from dist_scripts.ckpt_common import DP2_TP2, DP4, MESH_2X4, SHAPES, TP2, build_state, check_state, full_tensors

FULL = full_tensors()


def _save_dp2_tp2(path, **kw):
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"])
        state = build_state(mesh, DP2_TP2, FULL)
        return save_state_dict(state, path, step=7, extra={"strategy": {"dp": 2, "tp": 2}}, **kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _save_dp2_tp2(str(tmp_path_factory.mktemp("ckpt") / "dp2tp2"))


@pytest.mark.parametrize("world, ranks, names, layout", [
    (2, [0, 1], ["tp"], TP2),
    (4, [0, 1, 2, 3], ["dp"], DP4),
    (8, [[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "tp"], MESH_2X4),
    (4, [[3, 1], [2, 0]], ["dp", "tp"], DP2_TP2),
    (4, [[0, 1], [2, 3]], ["dp", "tp"], DP2_TP2),
])
def test_load_reshards_into_another_layout(saved, world, ranks, names, layout):
    with ap.simulate(world_size=world):
        mesh = ap.ProcessMesh(ranks, names)
        target = build_state(mesh, layout)
        assert check_state(target, FULL)            # negative control: zeros differ from the truth
        info = load_state_dict(target, saved)
        assert check_state(target, FULL) == []
    assert info.step == 7 and info.extra == {"strategy": {"dp": 2, "tp": 2}}


def test_load_into_one_process_and_merged(saved):
    target = {"model": {n: paddle.zeros(list(s), dtype=d) for n, (s, d) in SHAPES.items()},
              "plain": paddle.zeros([8, 6]), "host": {"array": np.zeros(5)}, "loader": {}}
    target["loader"] = {"epoch": 0, "index": 0}
    load_state_dict(target, saved)
    for name in SHAPES:
        np.testing.assert_array_equal(target["model"][name].numpy(), FULL[name])
    assert target["loader"] == {"epoch": 2, "index": 640}
    merged = load_merged_state_dict(saved)
    assert set(merged["model"]) == set(SHAPES)
    for name in SHAPES:
        assert merged["model"][name].dtype == FULL[name].dtype
        np.testing.assert_array_equal(merged["model"][name], FULL[name])
    np.testing.assert_array_equal(merged["host"]["array"], np.arange(5.0))
    assert merged["loader"] == {"epoch": 2, "index": 640}


def test_each_box_is_written_once(saved):
    meta = json.load(open(os.path.join(saved, "metadata.json")))
    for name, rec in meta["tensors"].items():
        covered = sum(int(np.prod(s["shape"])) for s in rec["shards"])
        assert covered == int(np.prod(rec["shape"])), name
    # a tensor replicated over dp is written by the dp-coordinate-0 ranks only
    assert sorted(s["file"] for s in meta["tensors"]["model/w"]["shards"]) == ["data-r00000.bin", "data-r00001.bin"]
    data = sum(rec["nbytes"] for t in meta["tensors"].values() for rec in t["shards"])
    expected = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in SHAPES.values()) + FULL["w"].nbytes + 5 * 8
    assert data == expected
    # partial tensors are reduced before saving: the file holds the value
    assert meta["tensors"]["model/p"]["placements"] == ["R", "R"]


def test_load_reads_only_the_needed_bytes(tmp_path):
    full = np.arange(64 * 16, dtype="float32").reshape(64, 16)
    path = save_state_dict({"x": paddle.to_tensor(full)}, str(tmp_path / "c"), block_bytes=256)
    target = ap.shard_tensor(paddle.zeros([64, 16]), ap.ProcessMesh([0, 1, 2, 3], ["x"]), [ap.Shard(0)])
    assert sorted(target.locals) == [0]             # one process: this rank's shard only
    info = load_state_dict({"x": target}, path)
    np.testing.assert_array_equal(target.local.numpy(), full[:16])
    assert info.bytes_read == 16 * 16 * 4           # a quarter of the 4096 saved bytes
    # a modified block this rank does not read goes unnoticed here, but not by a full load
    data = os.path.join(path, "data-r00000.bin")
    with open(data, "r+b") as f:
        f.seek(3000)
        f.write(b"\xff\xff\xff\xff")
    load_state_dict({"x": target}, path)
    with pytest.raises(CheckpointCorruptError, match="data-r00000.bin.*checksum mismatch in block 11"):
        load_merged_state_dict(path)


def test_dtypes_round_trip(tmp_path):
    values = {"bf16": paddle.to_tensor([1.5, -2.25, 3.0], dtype="bfloat16"),
              "bool": paddle.to_tensor([True, False, True]), "i32": paddle.to_tensor([1, -7], dtype="int32"),
              "scalar": paddle.full([], 3.5), "empty": paddle.zeros([0, 3])}
    path = save_state_dict(values, str(tmp_path / "c"))
    target = {"bf16": paddle.zeros([3], dtype="bfloat16"), "bool": paddle.zeros([3], dtype="bool"),
              "i32": paddle.zeros([2], dtype="int32"), "scalar": paddle.zeros([]), "empty": paddle.ones([0, 3])}
    load_state_dict(target, path)
    np.testing.assert_array_equal(target["bf16"].astype("float32").numpy(), [1.5, -2.25, 3.0])
    np.testing.assert_array_equal(target["bool"].numpy(), [True, False, True])
    np.testing.assert_array_equal(target["i32"].numpy(), [1, -7])
    assert float(target["scalar"]) == 3.5


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_state_dict({}, str(tmp_path / "nope"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_state_dict({}, str(tmp_path / "empty"))


def _target_on_2_ranks():
    mesh = ap.ProcessMesh([0, 1], ["tp"])
    return build_state(mesh, TP2)


def _held_values(state):
    return {n: {r: t.numpy().copy() for r, t in v.locals.items()} for n, v in state["model"].items()}


def test_truncated_shard_names_the_file_and_changes_nothing(tmp_path):
    path = _save_dp2_tp2(str(tmp_path / "c"))
    victim = os.path.join(path, "data-r00002.bin")
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size - 8)
    with ap.simulate(world_size=2):
        target = _target_on_2_ranks()
        before = _held_values(target)
        with pytest.raises(CheckpointCorruptError, match=rf"data-r00002.bin: data file is {size - 8} bytes, the "
                                                         rf"metadata expects {size}"):
            load_state_dict(target, path)
        after = _held_values(target)
    assert all(np.array_equal(before[n][r], after[n][r]) for n in before for r in before[n])
    assert target["loader"] == {"epoch": 0, "index": 0}


def test_tampered_shard_names_the_file_and_changes_nothing(tmp_path):
    path = _save_dp2_tp2(str(tmp_path / "c"))
    victim = os.path.join(path, "data-r00003.bin")
    with open(victim, "r+b") as f:
        f.seek(4)
        byte = f.read(1)
        f.seek(4)
        f.write(bytes([byte[0] ^ 1]))
    with ap.simulate(world_size=2):
        target = _target_on_2_ranks()
        before = _held_values(target)
        with pytest.raises(CheckpointCorruptError, match="data-r00003.bin: checksum mismatch"):
            load_state_dict(target, path)
        after = _held_values(target)
    assert all(np.array_equal(before[n][r], after[n][r]) for n in before for r in before[n])
    with pytest.raises(CheckpointCorruptError, match="data-r00003.bin: whole-file checksum mismatch"):
        verify_checkpoint(path)


def test_names_and_shapes_that_differ_are_listed_and_nothing_is_overwritten(saved):
    with ap.simulate(world_size=2):
        target = _target_on_2_ranks()
        mesh = ap.ProcessMesh([0, 1], ["tp"])
        target["model"]["renamed"] = target["model"].pop("v")
        target["model"]["w"] = ap.shard_tensor(paddle.zeros([8, 7]), mesh, [ap.Shard(0)])
        target["model"]["ids"] = ap.shard_tensor(paddle.zeros([5, 2], dtype="int32"), mesh, [ap.Replicate()])
        before = _held_values(target)
        with pytest.raises(CheckpointMismatchError) as err:
            load_state_dict(target, saved)
        after = _held_values(target)
    text = str(err.value)
    assert "missing from the checkpoint: ['model/renamed']" in text
    assert "in the checkpoint but not in the state (strict=True): ['model/v']" in text
    assert "'model/w': shape [8, 7] in the state, [8, 6] in the checkpoint" in text
    assert "'model/ids': dtype int32 in the state, int64 in the checkpoint" in text
    assert "nothing was loaded" in text
    assert all(np.array_equal(before[n][r], after[n][r]) for n in before for r in before[n])
    assert target["loader"] == {"epoch": 0, "index": 0}


def test_non_strict_load_takes_a_subset(saved):
    target = {"model": {"w": paddle.zeros([8, 6])}}
    load_state_dict(target, saved, strict=False)
    np.testing.assert_array_equal(target["model"]["w"].numpy(), FULL["w"])


def test_save_refuses_to_overwrite_and_bad_entries(saved, tmp_path):
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_state_dict({"a": 1}, saved)
    with pytest.raises(TypeError, match="'obj'.*neither a tensor"):
        save_state_dict({"obj": object()}, str(tmp_path / "x"))
    with pytest.raises(ValueError, match="must not contain '/'"):
        save_state_dict({"a/b": 1}, str(tmp_path / "y"))
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")
    assert read_checkpoint_info(saved).step == 7


def test_overwrite_replaces_a_checkpoint(tmp_path):
    path = str(tmp_path / "c")
    save_state_dict({"x": np.zeros(3)}, path, step=1)
    save_state_dict({"x": np.ones(3)}, path, step=2, overwrite=True)
    assert read_checkpoint_info(path).step == 2
    np.testing.assert_array_equal(load_merged_state_dict(path)["x"], np.ones(3))
    assert os.listdir(tmp_path) == ["c"]
