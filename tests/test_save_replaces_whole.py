"""``paddle.save`` under autoparallel writes a temporary file and renames it over the path once complete: a save
that fails half-way (here: an object whose pickling raises after part of the state dict was written) leaves the
previous file whole and no temporary behind. paddle alone truncates the previous file first."""
import io
import os

import numpy as np
import paddle
import pytest

import autoparallel  # noqa: F401  (installs the save wrapper)
from autoparallel import export_save

pytestmark = pytest.mark.pure


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("disk full")


def _state(v):
    return {"w": paddle.full([64, 64], float(v)), "step": v}


def test_a_failed_save_keeps_the_previous_file(tmp_path):
    export_save.install()
    path = str(tmp_path / "model.pdparams")
    paddle.save(_state(1), path)
    with pytest.raises(RuntimeError, match="disk full"):
        paddle.save({**_state(2), "z": _Unpicklable()}, path)
    back = paddle.load(path)
    assert back["step"] == 1 and np.all(back["w"].numpy() == 1.0)
    assert sorted(os.listdir(tmp_path)) == ["model.pdparams"]


def test_paddle_alone_loses_the_previous_file(tmp_path):
    """The control: the same failing save through paddle's own function leaves a truncated file."""
    export_save.install()
    path = str(tmp_path / "model.pdparams")
    paddle.save(_state(1), path)
    with pytest.raises(RuntimeError, match="disk full"):
        paddle.save.__wrapped__({**_state(2), "z": _Unpicklable()}, path)
    with pytest.raises(Exception):
        paddle.load(path)


def test_saves_round_trip_and_buffers_and_bad_paths_behave_as_paddle(tmp_path):
    export_save.install()
    path = str(tmp_path / "sub" / "t.pdtensor")                 # paddle makes the directory
    paddle.save(paddle.arange(6), path)
    paddle.save(paddle.arange(3), path)                          # replaced whole
    assert paddle.load(path).numpy().tolist() == [0, 1, 2]
    assert os.listdir(tmp_path / "sub") == ["t.pdtensor"]
    buf = io.BytesIO()
    paddle.save({"a": paddle.ones([2])}, buf)
    buf.seek(0)
    assert paddle.load(buf)["a"].numpy().tolist() == [1.0, 1.0]
    with pytest.raises(ValueError):
        paddle.save({"a": 1}, str(tmp_path) + os.sep)            # no file name: paddle's error
