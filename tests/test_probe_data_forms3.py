"""``ap.shard_dataloader`` in paddle's iterator forms (``next(loader)`` without ``iter``, ``loader()`` restarting,
``loader.batch_sampler``), its argument checks (shard_dims, dense_tensor_idx, input_keys per mesh: typed errors
at construction), fields that are 0-d tensors, DistTensors or whole numpy batches, and an SGD run driven by
``next(loader)`` under dp2 x tp2 against one process (simulated world)."""
from collections import UserDict

import numpy as np
import paddle
import pytest

import autoparallel as ap


class Rows(paddle.io.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return np.full([3], i, "float32"), np.array([i], "int64")


def _ids(b):
    return b[1].full().numpy().ravel().tolist()


@pytest.fixture
def mesh():
    with ap.simulate(world_size=4):
        yield ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


def test_next_without_iter_continues_and_loader_call_restarts(mesh):
    """paddle's ShardDataloader is its own iterator: ``next(loader)`` without ``iter`` (TypeError before), it goes
    on from a ``for`` that stopped early, ``loader()`` restarts; ``batch_sampler`` is the wrapped loader's."""
    loader = ap.shard_dataloader(paddle.io.DataLoader(Rows(), batch_size=4), mesh, shard_dims="dp")
    assert _ids(next(loader)) == [0, 1, 2, 3] and _ids(next(loader)) == [4, 5, 6, 7]
    for b in loader:
        break
    assert _ids(next(loader)) == [4, 5, 6, 7] and _ids(next(loader)) == [8, 9]
    with pytest.raises(StopIteration):
        next(loader)
    assert _ids(next(loader())) == [0, 1, 2, 3]
    assert [_ids(b) for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    sampler = paddle.io.DistributedBatchSampler(Rows(), batch_size=4, shuffle=True)
    loader = ap.shard_dataloader(paddle.io.DataLoader(Rows(), batch_sampler=sampler), mesh, shard_dims="dp")
    assert loader.batch_sampler is sampler
    sampler.set_epoch(3)
    plain = [b[1].numpy().ravel().tolist() for b in paddle.io.DataLoader(Rows(), batch_sampler=sampler)]
    loader.batch_sampler.set_epoch(3)                   # paddle's per-epoch reshuffle call, through the wrapper
    assert [_ids(b) for b in loader] == plain


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(shard_dims=True), TypeError, ["shard_dims must be a mesh dim name or index", "got bool True"]),
    (dict(shard_dims={"x": "dp"}), TypeError, ["shard_dims must be a mesh dim name or index", "got dict"]),
    (dict(dense_tensor_idx=[0, 1]), TypeError, ["dense_tensor_idx must be one list of positions per field",
                                                "got [0, 1]"]),
    (dict(meshes="two", input_keys=["x"]), ValueError, ["input_keys ['x'] must name one dict key per mesh (2"]),
    (dict(meshes="two", shard_dims="mp"), ValueError, ["shard_dims 'mp' for mesh 1 (dims ['x']",
                                                       "got dim name 'mp'"]),
])
def test_bad_arguments_raise_at_construction(mesh, kwargs, exc, words):
    """Before: True sharded mesh dim 1, a dict raised an untyped mesh message, a flat dense_tensor_idx raised
    "'int' object is not iterable" at the first batch, an input_keys / meshes count mismatch only at the first
    batch, a dim missing from the second mesh without saying which mesh."""
    if kwargs.get("meshes") == "two":
        kwargs["meshes"] = [mesh, ap.ProcessMesh([0, 1], dim_names=["x"])]
    loader = paddle.io.DataLoader(Rows(), batch_size=4)
    with pytest.raises(exc) as info:
        ap.shard_dataloader(loader, **{"meshes": mesh, **kwargs})
    assert all(w in str(info.value) for w in words), str(info.value)


def test_scalar_fields_numpy_batches_and_dist_tensor_fields(mesh):
    """A 0-d tensor field (a token count) is replicated (it raised "S(0) is out of range for a tensor of rank 0");
    a whole numpy batch and complex arrays are laid out (a TypeError / left numpy before); a field that is
    already a DistTensor is moved to the asked layout (it kept its own, the shard_dims ignored)."""
    x = np.arange(8, dtype="float32").reshape(4, 2)
    b = next(ap.shard_dataloader([{"x": x, "n": paddle.to_tensor(7), "c": x.astype("complex64")}], mesh,
                                 shard_dims="dp"))
    assert b["n"].placements == [ap.Replicate(), ap.Replicate()] and int(b["n"].full()) == 7
    assert b["c"].placements == [ap.Shard(0), ap.Replicate()] and np.array_equal(b["c"].full().numpy(), x)
    whole = next(ap.shard_dataloader([x], mesh, shard_dims="mp"))
    assert whole.placements == [ap.Replicate(), ap.Shard(0)] and np.array_equal(whole.full().numpy(), x)
    inner = ap.shard_dataloader([(paddle.to_tensor(x),)], mesh, shard_dims="dp")
    (y,) = next(ap.shard_dataloader(inner, mesh, shard_dims="mp"))
    assert y.placements == [ap.Replicate(), ap.Shard(0)] and np.array_equal(y.full().numpy(), x)
    with pytest.raises(ValueError, match=r"batch field 'n' is a 0-d tensor .*no dim 0 to stack"):
        next(ap.shard_dataloader([{"n": paddle.to_tensor(7)}], mesh, shard_dims="dp", is_dataset_splitted=True))


def test_mapping_batches_are_laid_out_like_dicts(mesh):
    """A tokenizer's ``BatchEncoding`` (a ``UserDict``, not a dict) yielded straight from an iterable of collated
    batches, with a nested mapping: laid out as a dict batch (a TypeError before; paddle's DataLoader turns it into
    a dict itself)."""
    x = np.arange(8).reshape(4, 2)
    batch = UserDict(input_ids=x, extra=UserDict(mask=x % 2))
    out = next(ap.shard_dataloader([batch], mesh, input_keys=["input_ids", "extra"], shard_dims="dp"))
    assert isinstance(out, dict) and sorted(out) == ["extra", "input_ids"]
    for t in (out["input_ids"], out["extra"]["mask"]):
        assert t.placements == [ap.Shard(0), ap.Replicate()]
    assert np.array_equal(out["extra"]["mask"].full().numpy(), x % 2)


@pytest.mark.parametrize("names", [("data", "model"), ("dp", "mp")], ids="-".join)
def test_sgd_driven_by_next_equals_one_process(names):
    """paddle's loop form ``it = loader(); next(it)`` for two epochs of 10 rows in batches of 3 (the last of 1 over
    dp 2), labels with -100, an MLP under dp2 x tp2: every loss and the final parameters as one process. The
    loader's mesh is the Strategy's, or the same ranks under paddle's dim names (read as the model's mesh)."""
    rng = np.random.RandomState(0)
    xs, ys = rng.randn(10, 6).astype("float32"), rng.randint(0, 4, [10]).astype("int64")
    ys[[1, 4]] = -100
    rows = [{"x": xs[i], "labels": ys[i]} for i in range(10)]

    def run(wrap, layout=None):
        paddle.seed(0)
        model = paddle.nn.Sequential(paddle.nn.Linear(6, 8), paddle.nn.ReLU(), paddle.nn.Linear(8, 4))
        opt = paddle.optimizer.SGD(0.5, parameters=model.parameters())
        if layout:
            s = ap.Strategy()
            s.data_parallel.degree, s.tensor_parallel.degree = layout
            model, opt = ap.parallelize(model, opt, strategy=s)
        loader, losses = wrap(paddle.io.DataLoader(rows, batch_size=3)), []
        for _ in range(2):
            it = loader()
            for _ in range(len(loader)):
                b = next(it)
                loss = paddle.nn.functional.cross_entropy(model(b["x"]), b["labels"])
                loss.backward()
                opt.step()
                opt.clear_grad()
                losses.append(float(loss))
        return losses, [(p.full() if hasattr(p, "full") else p).numpy() for p in model.parameters()]

    ref = run(lambda ld: ld)
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=list(names))
        got = run(lambda ld: ap.shard_dataloader(ld, mesh, shard_dims=names[0]), (2, 2))
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    assert len(got[0]) == 8
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_split_sampler_must_match_the_shard_dim():
    """Real ranks, is_dataset_splitted=True, a data dim of 4: a DistributedBatchSampler over 2 replicas gives ranks
    0 and 2 the same part; the parts have equal shapes, so the cross-rank check let the global batch repeat half
    the samples and leave out the rest. (local_rank, nranks) must be the rank's coordinate and the dim size."""
    from autoparallel.api_data import _check_split_sampler

    dp4 = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    two_d = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    for mesh, rank, replicas, part in ((dp4, 2, 4, 2), (two_d, 2, 2, 1), (two_d, 1, 2, 0)):
        sampler = paddle.io.DistributedBatchSampler(Rows(), batch_size=2, num_replicas=replicas, rank=part)
        _check_split_sampler(sampler, [mesh], ["dp"], rank)
    bad = paddle.io.DistributedBatchSampler(Rows(), batch_size=2, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match=r"gives rank 2 part 0 of 2, but shard dim 'dp' of the mesh \['dp'\] \[4\] "
                                         r"stacks 4 parts with this rank's at 2; build the sampler with "
                                         r"num_replicas=4, rank=2"):
        _check_split_sampler(bad, [dp4], ["dp"], 2)
    _check_split_sampler(bad, [dp4], [None], 2)             # not split over a dim: nothing to match
