"""Checkpoints never lose the user's data and are data only.

Data safety: each destructive case (overwrite of a user directory, of a run root, a second run on the same
root, a failed save) is refused or cleaned up, and the user's files are byte-identical afterwards; the
negative controls show the same calls do replace what is ours. Data only: a pickle payload planted in a
checkpoint is refused and never executed; metadata sizes are checked before any allocation.
"""
import base64
import contextlib
import errno
import json
import os
import pickle
import signal

import numpy as np
import pytest

from autoparallel.checkpoint import (CheckpointCorruptError, CheckpointManager, CheckpointMismatchError,
                                     CheckpointOwnershipError,
                                     CheckpointRootError, load_merged_state_dict, load_state_dict,
                                     save_state_dict)
from autoparallel.checkpoint import read_checkpoint_info, run_root, training_state, verify_checkpoint

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "autoparallel", "checkpoint")


@contextlib.contextmanager
def deadline(seconds=20):
    """Fail instead of hanging: SIGALRM raises after ``seconds``."""
    def fire(*_):
        raise TimeoutError(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def snapshot(root) -> dict:
    """{relative path: bytes (files) or None (directories)} of everything under ``root``."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.relpath(os.path.join(dirpath, f), root)] = fh.read()
    return out


def user_dir(path):
    os.makedirs(os.path.join(path, "sub"))
    with open(os.path.join(path, "thesis.tex"), "w") as f:
        f.write("years of work")
    with open(os.path.join(path, "sub", "data.csv"), "w") as f:
        f.write("1,2,3")
    return str(path)


def run(tmp_path, steps=(1, 2)):
    mgr = CheckpointManager(str(tmp_path / "run"), save_interval_steps=1)
    for s in steps:
        mgr.save({"x": np.full(3, float(s))}, s)
    return mgr


# ---- overwrite=True replaces only a checkpoint of ours --------------------------------------------------
def test_overwrite_refuses_a_user_directory_and_leaves_it_byte_identical(tmp_path):
    path = user_dir(tmp_path / "mine")
    before = snapshot(tmp_path)
    with deadline(), pytest.raises(CheckpointOwnershipError, match=r"not a checkpoint written by autoparallel.*"
                                                                   r"sub.*thesis\.tex"):
        save_state_dict({"x": np.ones(3)}, path, overwrite=True)
    assert snapshot(tmp_path) == before


def test_overwrite_refuses_a_file_a_symlink_and_a_run_root(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    target = user_dir(tmp_path / "target")
    os.symlink(target, tmp_path / "link")
    mgr = run(tmp_path)
    before = snapshot(tmp_path)
    with deadline():
        with pytest.raises(CheckpointOwnershipError, match="is a file"):
            save_state_dict({"x": np.ones(3)}, str(f), overwrite=True)
        with pytest.raises(CheckpointOwnershipError, match="symbolic link"):
            save_state_dict({"x": np.ones(3)}, str(tmp_path / "link"), overwrite=True)
        with pytest.raises(CheckpointOwnershipError, match=r"run root .*step-00000001.*step-00000002"):
            save_state_dict({"x": np.ones(3)}, mgr.dir, overwrite=True)
    assert snapshot(tmp_path) == before


def test_overwrite_refuses_a_checkpoint_holding_a_user_file(tmp_path):
    path = str(tmp_path / "c")
    save_state_dict({"x": np.zeros(3)}, path, step=1)
    (tmp_path / "c" / "my_notes.md").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointOwnershipError, match=r"entries no save writes: \['my_notes.md'\]"):
        save_state_dict({"x": np.ones(3)}, path, overwrite=True)
    assert snapshot(tmp_path) == before


def test_negative_control_overwrite_replaces_our_checkpoint(tmp_path):
    path = str(tmp_path / "c")
    save_state_dict({"x": np.zeros(3)}, path, step=1)
    assert os.path.isfile(os.path.join(path, ".autoparallel-checkpoint"))
    save_state_dict({"x": np.ones(3)}, path, step=2, overwrite=True)
    np.testing.assert_array_equal(load_merged_state_dict(path)["x"], np.ones(3))
    assert sorted(os.listdir(tmp_path)) == ["c"]


# ---- a run root belongs to one run ----------------------------------------------------------------------
def test_a_second_run_on_the_same_root_is_refused_and_the_first_kept(tmp_path):
    first = run(tmp_path)
    before = snapshot(first.dir)
    second = CheckpointManager(first.dir, save_interval_steps=1)
    with deadline():
        with pytest.raises(CheckpointOwnershipError, match=r"checkpoints of a run \(steps \[1, 2\], newest 2\).*"
                                                           r"--resume"):
            second.start({"x": np.zeros(3)})
        with pytest.raises(CheckpointOwnershipError, match="checkpoints of a run"):
            second.save({"x": np.full(3, 9.0)}, 1)            # no start(): the first save checks the same
    assert snapshot(first.dir) == before
    third = CheckpointManager(first.dir, save_interval_steps=1)      # negative control: resuming continues
    target = {"x": np.zeros(3)}
    assert third.start(target, resume=True).step == 2 and target["x"].tolist() == [2.0] * 3
    third.save({"x": np.full(3, 3.0)}, 3)
    assert open(os.path.join(first.dir, "latest")).read().strip() == "step-00000003" == \
        os.path.basename(third.latest())


def test_a_new_run_refuses_a_directory_of_user_files(tmp_path):
    path = user_dir(tmp_path / "home")
    before = snapshot(path)
    for resume in (False, True):
        with deadline(), pytest.raises(CheckpointOwnershipError, match=r"not a checkpoint run root.*"
                                                                       r"\['sub', 'thesis.tex'\]"):
            CheckpointManager(path).start({"x": np.zeros(3)}, resume=resume)
    assert snapshot(path) == before


def test_steps_only_grow_so_latest_and_resume_agree(tmp_path):
    mgr = run(tmp_path, steps=(5,))
    before = snapshot(mgr.dir)
    with pytest.raises(ValueError, match=r"step 3 is older than the newest checkpoint .*\(step 5\)"):
        mgr.save({"x": np.zeros(3)}, 3)
    assert snapshot(mgr.dir) == before
    mgr.save({"x": np.full(3, 7.0)}, 5)                      # the same step again (a final save): replaced
    (tmp_path / "run" / "latest").write_text("step-00000001\n")   # a stale pointer (crash after a commit)
    CheckpointManager(mgr.dir).start(resume=True)
    assert open(os.path.join(mgr.dir, "latest")).read().strip() == "step-00000005"


# ---- failed and interrupted saves -----------------------------------------------------------------------
@pytest.mark.parametrize("phase", ["shard_half_written", "before_metadata_rename"])
def test_a_failed_save_disk_full_leaves_nothing_and_keeps_the_previous(tmp_path, monkeypatch, phase):
    mgr = run(tmp_path, steps=(1,))
    before = snapshot(mgr.dir)
    monkeypatch.setenv("AP_CKPT_FAULT", f"{phase}:enospc")
    with deadline(), pytest.raises(OSError) as err:
        mgr.save({"x": np.full(3, 2.0)}, 2)
    assert err.value.errno == errno.ENOSPC
    assert snapshot(mgr.dir) == before                        # no partial directory, step 1 and latest intact
    with pytest.raises(OSError):
        save_state_dict({"x": np.ones(3)}, str(tmp_path / "one"))
    assert not any(n.startswith("one") for n in os.listdir(tmp_path))
    monkeypatch.delenv("AP_CKPT_FAULT")
    mgr.save({"x": np.full(3, 2.0)}, 2)                       # negative control: the retry succeeds
    assert mgr.steps() == [1, 2]


def test_start_removes_our_stale_partials_only_and_restores_an_interrupted_overwrite(tmp_path):
    mgr = run(tmp_path, steps=(1, 2))
    root = mgr.dir
    os.rename(os.path.join(root, "step-00000002"), os.path.join(root, "step-00000002.tmp-old-0123456789ab"))
    os.makedirs(os.path.join(root, "step-00000003.tmp-00000000abcd"))
    (tmp_path / "run" / "step-00000003.tmp-00000000abcd" / "data-r00000.bin").write_bytes(b"\0" * 10)
    mine = tmp_path / "run" / "backup.tmp-0123456789ab"            # the user's, named like a temporary dir
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with deadline():
        CheckpointManager(root).start(resume=True)
    assert sorted(os.listdir(root)) == [".autoparallel-run", "backup.tmp-0123456789ab", "latest", "step-00000001",
                                        "step-00000002"]
    assert (mine / "notes.txt").read_text() == "mine"
    np.testing.assert_array_equal(load_merged_state_dict(root)["x"], np.full(3, 2.0))


# ---- the root is validated before the first training step ------------------------------------------------
def test_root_that_is_a_file_or_under_a_file_is_refused(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    for root in (f, f / "sub"):
        with deadline(), pytest.raises(CheckpointRootError, match="is a file|cannot be created"):
            CheckpointManager(str(root)).start({"x": np.zeros(3)})
    assert f.read_text() == "x"


def test_root_that_is_not_writable_is_refused():
    root = "/sys/kernel"
    if not os.path.isdir(root) or os.access(root, os.W_OK) and _writable(root):
        pytest.skip("needs a read-only directory (/sys/kernel)")
    with deadline(), pytest.raises(CheckpointRootError, match="is not writable by rank 0"):
        CheckpointManager(root).start()


def _writable(path):
    try:
        os.close(os.open(os.path.join(path, ".ap-w"), os.O_CREAT | os.O_WRONLY))
        os.remove(os.path.join(path, ".ap-w"))
        return True
    except OSError:
        return False


def test_free_space_for_one_checkpoint_is_checked_from_the_state_size(tmp_path, monkeypatch):
    state = {"w": np.zeros((256, 1024), np.float32), "step": 3}        # 1 MiB of tensors
    need = run_root.estimate_bytes(state)
    assert need == 256 * 1024 * 4 + len("3") + run_root.OVERHEAD_BYTES
    monkeypatch.setattr(run_root, "free_bytes", lambda path: need - 1)
    with pytest.raises(CheckpointRootError, match=r"needs about 2\.0 MiB, its filesystem has 2\.0 MiB free"):
        CheckpointManager(str(tmp_path / "r")).start(state)
    monkeypatch.setattr(run_root, "free_bytes", lambda path: need)       # negative control: just enough
    CheckpointManager(str(tmp_path / "r")).start(state)


def test_the_training_example_refuses_a_bad_root_before_the_first_step(tmp_path, monkeypatch):
    import train_common

    run_dir = str(tmp_path / "ck")
    base = ["--steps", "2", "--seq-len", "8", "--batch-size", "2", "--ckpt-dir", run_dir, "--save-every", "1"]
    train_common.train(train_common.make_parser("gpt-tiny").parse_args(base))
    before = snapshot(run_dir)
    steps = []
    monkeypatch.setattr(train_common, "_progress", lambda *a, **k: steps.append(1) or range(0))
    with pytest.raises(CheckpointOwnershipError, match="--resume"):
        train_common.train(train_common.make_parser("gpt-tiny").parse_args(base))
    assert steps == [] and snapshot(run_dir) == before          # refused before any training step


# ---- checkpoints are data, never code ---------------------------------------------------------------------
class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))            # unpickling it would create this file


def _runtime_checkpoint(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"), 1)
    mgr.save({"x": np.zeros(3)}, 1)
    return mgr, os.path.join(mgr.dir, "step-00000001")


def _edit_metadata(ckpt, fn):
    """Edit metadata.json as a crafted file would: its own checksum recomputed (format.METADATA_CRC), so the
    checks behind it are what refuses the edit."""
    from autoparallel.checkpoint.format import encode_metadata

    path = os.path.join(ckpt, "metadata.json")
    meta = json.load(open(path))
    fn(meta)
    with open(path, "wb") as f:
        f.write(encode_metadata(meta))


def test_generator_states_are_plain_arrays_in_the_data_files(tmp_path):
    _, ckpt = _runtime_checkpoint(tmp_path)
    meta = json.load(open(os.path.join(ckpt, "metadata.json")))
    assert meta["runtime"]["rng"] == {"world_size": 1}
    rt = meta["runtime_tensors"]
    assert {n: (r["dtype"], r["shape"][0]) for n, r in rt.items()} == {
        "rng/numpy_gauss": ("float64", 1), "rng/numpy_key": ("int64", 1), "rng/numpy_pos_gauss": ("int64", 1),
        "rng/paddle_device": ("int64", 1), "rng/paddle_engine": ("int64", 1),
        "rng/paddle_seed_offset": ("int64", 1), "rng/python_gauss": ("float64", 1),
        "rng/python_state": ("int64", 1)}
    assert all(s["file"] == "data-r00000.bin" for r in rt.values() for s in r["shards"])


def test_a_planted_pickle_payload_is_refused_and_never_executed(tmp_path):
    mgr, ckpt = _runtime_checkpoint(tmp_path)
    sentinel = str(tmp_path / "pwned")
    blob = base64.b64encode(pickle.dumps(_Payload(sentinel))).decode()

    def plant(meta):                                    # the pickled form older checkpoints used
        meta["runtime"]["rng"] = {"world_size": 1, "states": [blob]}
        meta["runtime_tensors"] = {}

    _edit_metadata(ckpt, plant)
    with deadline(), pytest.raises(CheckpointCorruptError, match=r"unexpected fields \['states'\].*never unpickled"):
        CheckpointManager(mgr.dir).restore({"x": np.zeros(3)})
    assert not os.path.exists(sentinel)
    # the same bytes as a data file's content are read as numbers, never interpreted
    data = pickle.dumps(_Payload(sentinel))[:24].ljust(24, b"\0")
    save_state_dict({"x": np.frombuffer(data, np.uint8).copy()}, str(tmp_path / "raw"))
    np.testing.assert_array_equal(load_merged_state_dict(str(tmp_path / "raw"))["x"], np.frombuffer(data, np.uint8))
    assert not os.path.exists(sentinel)


def test_no_unpickling_anywhere_in_the_checkpoint_package():
    for name in os.listdir(PKG):
        if name.endswith(".py"):
            text = open(os.path.join(PKG, name)).read()
            for bad in ("import pickle", "pickle.load", "allow_pickle=True", "paddle.load(", "np.load(", "marshal"):
                assert bad not in text, f"{name} uses {bad}"


def test_tampered_generator_arrays_are_refused_before_any_generator_moves(tmp_path):
    import random

    mgr, ckpt = _runtime_checkpoint(tmp_path)
    _edit_metadata(ckpt, lambda m: m["runtime_tensors"]["rng/numpy_pos_gauss"].update(dtype="float64"))
    state = random.getstate()
    with pytest.raises(CheckpointCorruptError, match="numpy_pos_gauss.*int64 array of shape"):
        CheckpointManager(mgr.dir).restore({"x": np.zeros(3)})
    assert random.getstate() == state


@pytest.mark.parametrize("edit, match", [
    (lambda t, f: t.update(shape=[10 ** 15], shards=[dict(t["shards"][0], shape=[10 ** 15], nbytes=8 * 10 ** 15)]),
     r"spans bytes 0\.\.8000000000000000 of data-r00000.bin, which holds"),
    (lambda t, f: (t.update(shape=[10 ** 15], shards=[dict(t["shards"][0], shape=[10 ** 15], nbytes=8 * 10 ** 15,
                                                           block_bytes=1 << 60, crc32=[0])]),
                   f["data-r00000.bin"].update(size=8 * 10 ** 15)),
     r"data-r00000.bin: data file is \d+ bytes, the metadata expects 8000000000000000"),
    (lambda t, f: t.update(shape=[6]), r"its shards hold 3 elements, its shape \[6\] has 6"),
    (lambda t, f: t.update(dtype="object"), r"dtype 'object' is not one of"),
    (lambda t, f: t["shards"][0].update(file="../../etc/passwd"), r"refers to file '../../etc/passwd'"),
    (lambda t, f: f.update({"../x.bin": {"size": 1, "crc32": 0}}), r"'../x.bin' is not of the form"),
    (lambda t, f: t["shards"][0].update(offsets=[-1]), r"must be 1 ints >= 0"),
])
def test_metadata_sizes_are_checked_before_any_allocation(tmp_path, edit, match):
    path = str(tmp_path / "c")
    save_state_dict({"x": np.arange(3.0)}, path)
    _edit_metadata(path, lambda m: edit(m["tensors"]["x"], m["files"]))
    with deadline(10), pytest.raises(CheckpointCorruptError, match=match):
        load_merged_state_dict(path)
    with pytest.raises((CheckpointCorruptError, CheckpointMismatchError)):      # refused either way
        load_state_dict({"x": np.zeros(3)}, path)


# ---- bad input to the entry points: typed errors naming expected and given ------------------------------
def _linear():
    import paddle

    return paddle.nn.Linear(2, 2)


def _saved(tmp_path):
    path = str(tmp_path / "ok")
    save_state_dict({"x": np.zeros(3)}, path)
    return path


BAD_CALLS = [
    ("save: state", lambda p, t: save_state_dict([1], str(t / "a")), TypeError, "must be a dict.*got list"),
    ("save: path", lambda p, t: save_state_dict({"x": 1}, 7), TypeError, "path must be a str.*got int 7"),
    ("save: step type", lambda p, t: save_state_dict({"x": 1}, str(t / "a"), step="3"), TypeError,
     "step must be an int or None, got str"),
    ("save: step sign", lambda p, t: save_state_dict({"x": 1}, str(t / "a"), step=-1), ValueError,
     "step must be >= 0, got -1"),
    ("save: overwrite", lambda p, t: save_state_dict({"x": 1}, p, overwrite="yes"), TypeError,
     "overwrite must be a bool, got str"),
    ("save: exists", lambda p, t: save_state_dict({"x": 1}, p), FileExistsError, "pass overwrite=True"),
    ("save: block_bytes", lambda p, t: save_state_dict({"x": 1}, str(t / "a"), block_bytes=100), ValueError,
     "positive multiple of 64, got 100"),
    ("save: extra", lambda p, t: save_state_dict({"x": 1}, str(t / "a"), extra=object()), TypeError,
     "'extra'.*neither a tensor"),
    ("save: runtime", lambda p, t: save_state_dict({"x": 1}, str(t / "a"), runtime=[1]), TypeError,
     "runtime must be a dict.*got list"),
    ("load: state", lambda p, t: load_state_dict("x", p), TypeError, "must be a dict.*got str"),
    ("load: path", lambda p, t: load_state_dict({}, 3.5), TypeError, "str or os.PathLike, got float"),
    ("load: strict", lambda p, t: load_state_dict({}, p, strict=None), TypeError, "strict must be a bool"),
    ("load: missing", lambda p, t: load_state_dict({}, str(t / "none")), FileNotFoundError, "does not exist"),
    ("load: mismatch", lambda p, t: load_state_dict({"x": np.zeros(4)}, p), ValueError,
     r"shape \[4\] in the state, \[3\] in the checkpoint"),
    ("merged: path", lambda p, t: load_merged_state_dict(None), TypeError, "got NoneType"),
    ("merged: flat", lambda p, t: load_merged_state_dict(p, flat=1), TypeError, "flat must be a bool, got int"),
    ("merged: a file", lambda p, t: load_merged_state_dict(os.path.join(p, "data-r00000.bin")), FileNotFoundError,
     "is a file, expected a checkpoint directory"),
    ("verify: path", lambda p, t: verify_checkpoint(3), TypeError, "str or os.PathLike, got int"),
    ("verify: partial", lambda p, t: verify_checkpoint(p + ".tmp-0123456789ab"), FileNotFoundError,
     "does not exist"),
    ("info: missing", lambda p, t: read_checkpoint_info(str(t / "none")), FileNotFoundError, "does not exist"),
    ("training_state: model", lambda p, t: training_state(3), TypeError, "paddle.nn.Layer.*got int"),
    ("training_state: optimizer", lambda p, t: training_state(_linear(), "adam"), TypeError,
     "paddle optimizer.*got str"),
    ("manager: dir", lambda p, t: CheckpointManager(5), TypeError, "dir must be a path.*got int 5"),
    ("manager: interval", lambda p, t: CheckpointManager(str(t), save_interval_steps=1.5), ValueError,
     "save_interval_steps must be a positive int, got 1.5"),
    ("manager: keep_last", lambda p, t: CheckpointManager(str(t), keep_last=0), ValueError,
     "keep_last must be a positive int or None"),
    ("manager: enable", lambda p, t: CheckpointManager(str(t), enable="no"), TypeError, "enable must be a bool"),
    ("manager: resume", lambda p, t: CheckpointManager(str(t / "r")).start(resume="yes"), TypeError,
     "resume must be a bool, got str"),
    ("manager: step", lambda p, t: CheckpointManager(str(t / "r")).save({"x": 1}, -2), ValueError,
     "step must be a non-negative int, got -2"),
]


@pytest.mark.parametrize("case", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_a_typed_error_naming_expected_and_given(tmp_path, case):
    _, call, error, match = case
    path = _saved(tmp_path)
    before = snapshot(tmp_path)
    with deadline(10), pytest.raises(error, match=match):
        call(path, tmp_path)
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before      # nothing of before was changed


def test_reconfigure_bad_input_is_refused_before_any_work():
    import paddle

    from autoparallel.checkpoint import reconfigure, reshard_state

    model = paddle.nn.Linear(2, 2)
    opt = paddle.optimizer.SGD(parameters=model.parameters())
    configured = paddle.nn.Linear(2, 2)
    configured.config = {"in": 2}
    cases = [
        (lambda: reconfigure(configured, opt, "dp2"), TypeError, "new_strategy must be an ap.Strategy.*got str"),
        (lambda: reconfigure(model, opt, None, build=3), TypeError, "build must be a callable.*got int"),
        (lambda: reconfigure(model, opt, None, build=lambda s: model), TypeError,
         r"build\(new_strategy\) must return \(model, optimizer\), got Linear"),
        (lambda: reconfigure(model, opt, None, build=lambda s: (model, opt), state_fn=1), TypeError,
         "state_fn must be a callable"),
        (lambda: reconfigure(model, opt, None, build=lambda s: (model, opt), tmp_dir=5), TypeError,
         "tmp_dir must be a path.*got int"),
        (lambda: reconfigure(model, opt, None, build=lambda s: (model, opt), tmp_dir="/no/such/dir"),
         NotADirectoryError, "'/no/such/dir' is not an existing directory"),
        (lambda: reshard_state({"a": 1}, [1]), TypeError, "must be dicts.*got dict and list"),
    ]
    import autoparallel as ap

    with pytest.raises(TypeError, match=r"type\(model\)\(model.config\).*Linear has no .config"):
        reconfigure(model, opt, ap.Strategy())
    for call, error, match in cases:
        with deadline(10), pytest.raises(error, match=match):
            call()
