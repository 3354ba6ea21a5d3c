"""Loading a checkpoint through paddle's own calls, simulated ranks (docs/checkpoints.md):

* ``model.set_state_dict(sd)`` on a model with distributed parameters checks every entry before writing any. An
  entry that failed only while being written (a value of one shard's shape in the simulated world, a float64
  numpy array for a float32 parameter, a distributed value of another global shape) raised after the plain
  parameters and the distributed entries listed before it had been written: a half-loaded model. A distributed
  value of another dtype was cast silently (float16 into float32, or float32 into a float16 model); it is refused
  as paddle's ``set_value`` refuses a plain one.
* ``paddle.distributed.load_merged_state_dict(path)`` of autoparallel's checkpoint has paddle's form: one flat dict
  (nested keys joined with "."), paddle Tensors, ``prefix`` honoured. It was the nested dict of numpy arrays.
* A read-only numpy array in a state given to ``ap.load_state_dict`` is refused before anything is written.
"""
import numpy as np
import paddle
import paddle.distributed as pdist
import pytest
from paddle import nn

import autoparallel as ap


def build(dtype="float32"):
    """A Linear(4, 8) whose weight is column-split over 2 simulated ranks and whose bias stays a plain parameter,
    and a second Linear with both split (two distributed entries)."""
    mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
    paddle.seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    if dtype != "float32":
        m.to(dtype=dtype)
    m[0].weight = ap.shard_tensor(m[0].weight, mesh, [ap.Shard(1)])
    m[1].weight = ap.shard_tensor(m[1].weight, mesh, [ap.Shard(0)])
    m[1].bias = ap.shard_tensor(m[1].bias, mesh, [ap.Replicate()])
    return m, mesh


def snapshot(m):
    return {k: v.astype("float32").numpy() for k, v in ap.full_state_dict(m).items()}


def good(m):
    return {k: np.full(v.shape, 7.0, "float32") for k, v in snapshot(m).items()}


def bad_entries(mesh):
    """(entry, value, error, message): each fails only when written, and is listed after good entries."""
    return [("1.bias", np.zeros([2], "float32"), ValueError, r"1.bias has shape \[2\].*simulated world.*nothing"),
            ("1.bias", np.zeros([4], "float64"), TypeError, r"1.bias is float64.*float32.*nothing was loaded"),
            ("1.weight", ap.shard_tensor(paddle.zeros([8, 5]), mesh, [ap.Shard(0)]), ValueError,
             r"1.weight is a distributed value of global shape \[8, 5\].*\[8, 4\].*nothing was loaded"),
            ("1.weight", ap.shard_tensor(paddle.zeros([8, 4], "float16"), mesh, [ap.Shard(0)]), TypeError,
             r"1.weight is float16; the distributed parameter is float32.*nothing was loaded")]


@pytest.mark.parametrize("case", range(4))
def test_set_state_dict_failing_at_the_write_loads_nothing(case):
    with ap.simulate(world_size=2):
        m, mesh = build()
        before = snapshot(m)
        name, value, err, msg = bad_entries(mesh)[case]
        sd = dict(good(m), **{name: value})         # "0.bias" (plain) and "0.weight" (distributed) come first
        for call in (m.set_state_dict, m.set_dict, m.load_dict):
            with pytest.raises(err, match=msg):
                call(sd)
            after = snapshot(m)
            for k in before:
                np.testing.assert_array_equal(after[k], before[k], err_msg=f"{call.__name__}: {k} was written")
        missing, unexpected = m.set_state_dict(good(m))       # the good entries alone load
        assert missing == [] and unexpected == []
        for k, v in snapshot(m).items():
            np.testing.assert_array_equal(v, np.full(v.shape, 7.0), err_msg=k)


def test_a_bfloat16_file_from_paddle_load_return_numpy_still_loads(tmp_path):
    """paddle hands a bfloat16 tensor back as a uint16 numpy array (``return_numpy=True``) and its own
    ``set_state_dict`` takes it; the dtype check takes it as bfloat16 too."""
    paddle.seed(3)
    one = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    one.to(dtype="bfloat16")
    paddle.save(one.state_dict(), str(tmp_path / "m.pdparams"))
    want = {k: v.astype("float32").numpy() for k, v in one.state_dict().items()}
    for return_numpy in (True, False):
        loaded = paddle.load(str(tmp_path / "m.pdparams"), return_numpy=return_numpy)
        with ap.simulate(world_size=2):
            m, _ = build("bfloat16")
            assert m.set_state_dict(loaded) == ([], [])
            got = snapshot(m)
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v, err_msg=(return_numpy, k))


def nested(dist_values, mesh=None):
    w = paddle.arange(12, dtype="float32").reshape([4, 3])
    m = paddle.arange(3, dtype="float32") - 5
    if dist_values:
        w = ap.shard_tensor(w, mesh, [ap.Shard(0)])
    return {"model": {"fc.weight": w, "emb": {"table": paddle.ones([2, 2]).astype("bfloat16")}}, "opt": {"m": m}}


@pytest.fixture
def saved(tmp_path):
    """The same nested state saved by paddle's own writer (plain tensors) and through autoparallel's (one
    distributed tensor among them, 2 simulated ranks)."""
    pdist.save_state_dict(nested(False), str(tmp_path / "paddle"))
    with ap.simulate(world_size=2):
        pdist.save_state_dict(nested(True, ap.ProcessMesh([0, 1], dim_names=["x"])), str(tmp_path / "ours"))
    return tmp_path


@pytest.mark.parametrize("kwargs", [{}, {"prefix": "model"}, {"prefix": "opt", "offload": True}, {"prefix": "x"}])
def test_load_merged_state_dict_has_paddles_form(saved, kwargs):
    want = pdist.load_merged_state_dict(str(saved / "paddle"), **kwargs)
    got = pdist.load_merged_state_dict(str(saved / "ours"), **kwargs)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert isinstance(got[k], paddle.Tensor), k
        assert got[k].dtype == v.dtype, k
        np.testing.assert_array_equal(got[k].astype("float32").numpy(), v.astype("float32").numpy(), err_msg=k)


def test_load_merged_state_dict_positional_prefix_and_refused_options(saved):
    got = pdist.load_merged_state_dict(str(saved / "ours"), "model")
    assert sorted(got) == ["emb.table", "fc.weight"]
    with pytest.raises(NotImplementedError, match=r"unique_id=2"):
        pdist.load_merged_state_dict(str(saved / "ours"), None, 2)
    with pytest.raises(TypeError, match="comm_method"):        # not a parameter of paddle's function either
        pdist.load_merged_state_dict(str(saved / "ours"), comm_method="broadcast")
    with pytest.raises(TypeError, match="prefix must be a str"):
        pdist.load_merged_state_dict(str(saved / "ours"), prefix=3)


def test_a_read_only_numpy_target_loads_nothing(tmp_path):
    """A read-only array in the state (a memory-mapped ``.npy``) failed at its write, after the entries before it
    had been loaded (a bare ``assignment destination is read-only``)."""
    ap.save_state_dict({"a": paddle.ones([3]), "b": np.full([2], 4.0, "float32")}, str(tmp_path / "ck"))
    np.save(str(tmp_path / "b.npy"), np.zeros([2], "float32"))
    a, b = paddle.zeros([3]), np.load(str(tmp_path / "b.npy"), mmap_mode="r")
    with pytest.raises(TypeError, match=r"'b': a read-only numpy array.*nothing was loaded"):
        ap.load_state_dict({"a": a, "b": b}, str(tmp_path / "ck"))
    np.testing.assert_array_equal(a.numpy(), np.zeros(3))
    b = np.array(b)                                              # a writable copy loads
    ap.load_state_dict({"a": a, "b": b}, str(tmp_path / "ck"))
    np.testing.assert_array_equal(a.numpy(), np.ones(3))
    np.testing.assert_array_equal(b, np.full(2, 4.0))
