"""autoparallel.data: the standard-library text dataset and deterministic global-batch sharding."""
import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.data import ByteTextDataset, DistributedDataLoader, GlobalBatchSampler, stdlib_source_files
from autoparallel.parallelize import build_mesh


def test_dataset_is_stdlib_bytes_with_shifted_labels():
    files = stdlib_source_files()
    assert files == sorted(files) and any(f.endswith("os.py") for f in files)
    ds = ByteTextDataset(16, max_bytes=4096)
    assert len(ds) == (4096 - 1) // 16
    x, y = ds[3]
    assert x.dtype == np.int64 and x.shape == (16,) and (x[1:] == y[:-1]).all()
    with open(files[0], "rb") as f:
        head = np.frombuffer(f.read(17), dtype=np.uint8)
    assert (ds[0][0] == head[:16]).all() and (ds[0][1] == head[1:]).all()
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        ByteTextDataset(0)


def global_batches(dp, k, steps=3, seed=0, n=100, g=8):
    """Indices of each step's global batch, concatenated over micro-batches and data-parallel ranks."""
    its = [iter(GlobalBatchSampler(n, g, dp, r, k, seed=seed)) for r in range(dp)]
    out = []
    for _ in range(steps):
        out.append([i for _ in range(k) for it in its for i in next(it)])
    return out


def test_sampler_same_global_batches_for_every_layout():
    ref = global_batches(1, 1)
    assert global_batches(2, 1) == ref and global_batches(4, 2) == ref and global_batches(2, 4) == ref
    assert global_batches(1, 1, seed=1) != ref
    assert all(len(set(b)) == 8 for b in ref)
    s = GlobalBatchSampler(100, 8, 2, 1, 2)
    assert len(s) == 12 * 2 and all(len(b) == 2 for b in s)
    first = list(s)[0]
    s.set_epoch(1)
    assert list(s)[0] != first
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, 2\), got 2"):
        GlobalBatchSampler(100, 8, 2, 2)


def test_loader_shards_batch_over_data_and_replicates_over_model():
    ds = ByteTextDataset(16, max_bytes=8192)
    plain = list(DistributedDataLoader(ds, 8, num_micro_batches=2, seed=3))
    with ap.simulate(world_size=4):
        mesh = build_mesh(2, 2)
        loader = DistributedDataLoader(ds, 8, mesh=mesh, num_micro_batches=2, seed=3)
        assert len(loader) == len(plain)
        for (x, y), (px, py) in zip(loader, plain):
            assert x.placements == [ap.Shard(0), ap.Replicate()] and x.shape == [4, 16]
            np.testing.assert_array_equal(x.full().numpy(), px.numpy())
            np.testing.assert_array_equal(y.full().numpy(), py.numpy())
            np.testing.assert_array_equal(x.local_of(0).numpy(), x.local_of(1).numpy())     # TP peers
            assert not np.array_equal(x.local_of(0).numpy(), x.local_of(2).numpy())
    assert isinstance(plain[0][0], paddle.Tensor) and plain[0][0].shape == [4, 16]


def test_loader_cycles_epochs():
    ds = ByteTextDataset(16, max_bytes=16 * 17 + 1)        # 17 windows: 2 global batches of 8 per epoch
    loader = DistributedDataLoader(ds, 8, seed=0)
    it = loader.batches()
    got = [next(it)[0].numpy() for _ in range(5)]
    assert len(loader) == 2 and not np.array_equal(got[0], got[2])
    with pytest.raises(ValueError, match="fewer than one global batch of 32"):
        DistributedDataLoader(ds, 32)
