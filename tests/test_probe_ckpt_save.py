"""Checkpoint saves of the shapes users hit at the edges: a 0-d parameter (a learnable scale) under simulated data
parallel resumes bit for bit, and a save whose ranks' shards leave part of an entry unwritten is refused before
the commit, keeping the previous checkpoint, instead of committing a checkpoint that fails only when loaded."""
import os

import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.checkpoint import CheckpointSaveError, load_merged_state_dict, load_state_dict, save_state_dict
from autoparallel.checkpoint.state import training_state
from autoparallel.dist_tensor import as_dist


class ScaledNet(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        paddle.seed(0)
        self.fc = paddle.nn.Linear(8, 4)
        self.scale = self.create_parameter(shape=[], default_initializer=paddle.nn.initializer.Constant(1.5))

    def forward(self, x):
        return self.fc(x) * self.scale


def _step(model, opt, i):
    x = paddle.to_tensor(np.random.default_rng(i).standard_normal((4, 8)).astype("float32"))
    loss = (model(x) ** 2).mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
    return float(loss)


def _make():
    model = ScaledNet()
    opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
    return ap.DataParallel(model, strategy=ap.Strategy()), ap.Optimizer(opt)


def test_a_0d_parameter_saves_and_resumes_bit_for_bit(tmp_path):
    path = str(tmp_path / "ck")
    with ap.simulate(world_size=2):
        model, opt = _make()
        for i in range(2):
            _step(model, opt, i)
        save_state_dict(training_state(model, opt), path)
        saved_scale = float(model.scale.locals[0])
        want = [_step(model, opt, i) for i in range(2, 4)]
        model, opt = _make()
        assert float(model.scale.locals[0]) == 1.5 != saved_scale      # negative control: a fresh model differs
        load_state_dict(training_state(model, opt), path)
        assert [float(t) for t in model.scale.locals.values()] == [saved_scale] * 2
        assert [_step(model, opt, i) for i in range(2, 4)] == want
    merged = load_merged_state_dict(path)
    assert merged["model"]["scale"].shape == () and float(merged["model"]["scale"]) == saved_scale


def test_a_save_missing_a_ranks_shard_is_refused_and_the_previous_kept(tmp_path):
    path = str(tmp_path / "ck")
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], ["dp"])
        full = ap.shard_tensor(paddle.arange(8, dtype="float32"), mesh, [ap.Shard(0)])
        save_state_dict({"x": full}, path)                   # negative control: every shard held
        holed = as_dist(ap.shard_tensor(paddle.full([8], 5.0), mesh, [ap.Shard(0)]))
        del holed._locals[1]                                  # rank 1 does not pass its shard (as a real rank would)
        with pytest.raises(CheckpointSaveError, match=r"'x': its shards hold 4 elements, its shape \[8\] has 8"):
            save_state_dict({"x": holed}, path, overwrite=True)
        with pytest.raises(CheckpointSaveError, match="nothing was committed"):
            save_state_dict({"x": holed}, str(tmp_path / "new"))
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    np.testing.assert_array_equal(load_merged_state_dict(path)["x"], np.arange(8, dtype="float32"))


def test_json_values_come_back_as_saved_or_are_refused(tmp_path):
    values = {"betas": (0.9, 0.999), "nan": float("nan"), "big": 2 ** 70, "名前": "é\n", "none": None,
              "sched": {"last_epoch": 3, "last_lr": 0.01}, 7: [1, [2, 3]]}
    save_state_dict(values, str(tmp_path / "ok"))
    target = {"betas": (0.0, 0.0), "nan": 0.0, "big": 0, "名前": "", "none": 1, "sched": {"last_epoch": 0,
              "last_lr": 0.0}, 7: []}
    load_state_dict(target, str(tmp_path / "ok"))
    assert target["betas"] == (0.9, 0.999) and np.isnan(target["nan"])
    assert {k: v for k, v in target.items() if k not in ("betas", "nan")} == \
        {k: v for k, v in values.items() if k not in ("betas", "nan")}
    with pytest.raises(TypeError, match=r"'milestones': a dict inside it has the int key 10; .* load as '10'"):
        save_state_dict({"milestones": [{10: 0.1}]}, str(tmp_path / "bad"))
    with pytest.raises(TypeError, match="int key 1"):
        save_state_dict({"w": paddle.ones([2])}, str(tmp_path / "bad"), extra={"loader": {1: "x"}})
    assert sorted(os.listdir(tmp_path)) == ["ok"]


def test_a_path_that_cannot_hold_a_checkpoint_is_refused_before_any_write(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(NotADirectoryError, match="afile' is a file, not a directory"):
        save_state_dict({"w": paddle.ones([2])}, str(tmp_path / "afile" / "ck"))
    assert (tmp_path / "afile").read_text() == "mine"
    real = os.makedirs

    def read_only(path, *a, **k):                # a read-only parent (root ignores chmod, so the call is patched)
        if str(path).startswith(str(tmp_path / "ro")):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *a, **k)
    monkeypatch.setattr(os, "makedirs", read_only)
    with pytest.raises(PermissionError, match="Permission denied"):
        save_state_dict({"w": paddle.ones([2])}, str(tmp_path / "ro" / "ck"))
    assert sorted(os.listdir(tmp_path)) == ["afile"]


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-5", "soon"])
def test_the_rendezvous_timeout_is_finite(monkeypatch, value):
    from autoparallel.checkpoint import sync

    monkeypatch.setenv("AP_CKPT_TIMEOUT", value)
    with pytest.raises(ValueError, match="AP_CKPT_TIMEOUT must be a"):
        sync.save_timeout()
    monkeypatch.setenv("AP_CKPT_TIMEOUT", "12.5")                 # negative control
    assert sync.save_timeout() == 12.5


def test_a_save_takes_the_place_of_an_existing_empty_directory(tmp_path):
    """``tempfile.mkdtemp()`` then save into it (paddle's save_state_dict accepts it): the save is made and reads
    back; a directory that holds anything else is still refused."""
    empty = tmp_path / "made_by_mkdtemp"
    empty.mkdir()
    value = np.arange(6, dtype="float32").reshape(2, 3)
    save_state_dict({"w": paddle.to_tensor(value)}, str(empty))
    np.testing.assert_array_equal(np.asarray(load_merged_state_dict(str(empty))["w"]), value)

    busy = tmp_path / "holds_a_file"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists"):
        save_state_dict({"w": paddle.to_tensor(value)}, str(busy))
    assert (busy / "notes.txt").read_text() == "mine"
