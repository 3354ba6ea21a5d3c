"""Whole-model flows as a paddle user writes them: reading parameters (``p.numpy()``, ``p.full()``,
``state_dict``) after a ZeRO-3 step, and paddle's ``to_static`` docstring flow with a ``shard_dataloader`` on a
1-D mesh; values against a single-process run."""
import os

import numpy as np
import paddle
import paddle.nn.functional as F

import autoparallel as dist
from autoparallel.testing.models import batch, build
from dist_scripts import shared_launch


def loss_of(model, i):
    ids, lab = batch(i)
    return F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()


def adamw(params):
    return paddle.optimizer.AdamW(1e-2, parameters=params, epsilon=1e-4)


def reference(steps=2):
    m = build("gpt")
    opt = adamw(m.parameters())
    losses = []
    for i in range(steps):
        loss = loss_of(m, i)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: p.numpy() for n, p in m.named_parameters()}


def test_parameters_read_after_a_zero3_step_are_gathered():
    want_losses, want = reference()
    with dist.simulate(world_size=2):
        s = dist.Strategy()
        s.data_parallel.degree = 2
        s.sharding.enable, s.sharding.stage = True, 3
        m = build("gpt")
        m, opt = dist.parallelize(m, adamw(m.parameters()), strategy=s)
        for i in range(2):
            loss = loss_of(m, i)
            loss.backward()
            opt.step()
            opt.clear_grad()
        p = dict(m.named_parameters())["wte.weight"]
        assert not p._is_initialized()                       # released between uses
        np.testing.assert_allclose(p.numpy(), want["wte.weight"], rtol=1e-4, atol=2e-5)
        for n, q in m.named_parameters():
            np.testing.assert_allclose(q.full().numpy(), want[n], rtol=1e-4, atol=2e-5, err_msg=n)
        assert not p._is_initialized()                       # released again after the read
        loss = loss_of(m, 2)                                 # and training goes on
        assert np.isfinite(float(loss))


class _Pairs(paddle.io.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids, lab = batch(i // 4)
        return ids[i % 4], lab[i % 4]


def test_to_static_with_a_loader_on_a_1d_mesh_equals_one_process():
    want_losses, _ = reference()
    with dist.simulate(world_size=2):
        mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
        m = build("gpt")
        loader = dist.shard_dataloader(paddle.io.DataLoader(_Pairs(), batch_size=4), meshes=[mesh], shard_dims="x")
        dm = dist.to_static(m, loader, lambda logits, lab: F.cross_entropy(logits, lab).mean(), adamw(m.parameters()))
        dm.train()
        got = [float(dm(x, y)) for x, y in loader]
    np.testing.assert_allclose(got, want_losses, rtol=1e-4)


def test_same_ranks_view_only_for_meshes_of_the_same_ranks():
    from autoparallel.dist_tensor_forms import same_ranks_view

    with dist.simulate(world_size=4):
        x = dist.shard_tensor(paddle.ones([4, 2]), dist.ProcessMesh([0, 1], dim_names=["x"]), [dist.Shard(0)])
        v = same_ranks_view(x, dist.ProcessMesh([[0], [1]], dim_names=["data", "model"]))
        assert v.placements == [dist.Shard(0), dist.Replicate()]
        np.testing.assert_array_equal(v.numpy(), np.ones([4, 2]))
        assert same_ranks_view(x, dist.ProcessMesh([[1], [0]], dim_names=["a", "b"])) is None
        assert same_ranks_view(x, dist.ProcessMesh([2, 3], dim_names=["x"])) is None


class _Rows(paddle.io.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.full([6], i, "float32")


def test_a_loader_split_by_distributed_batch_sampler_needs_is_dataset_splitted():
    import pytest

    with dist.simulate(world_size=2):
        mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
        split = paddle.io.DistributedBatchSampler(_Rows(), batch_size=2, num_replicas=2, rank=0)
        with pytest.raises(ValueError, match="2 replicas.*is_dataset_splitted=True"):
            dist.shard_dataloader(paddle.io.DataLoader(_Rows(), batch_sampler=split), mesh, shard_dims="dp")
        whole = paddle.io.DistributedBatchSampler(_Rows(), batch_size=4)        # one replica: the global batch
        x = next(iter(dist.shard_dataloader(paddle.io.DataLoader(_Rows(), batch_sampler=whole), mesh,
                                            shard_dims="dp")))
        np.testing.assert_array_equal(x.numpy()[:, 0], np.arange(4))


PROBE = shared_launch.job(__name__, "probe_api", os.path.join(os.path.dirname(__file__), "dist_scripts",
                                                               "probe_api_worker.py"), 2, timeout=300)


def test_user_forms_on_real_ranks():
    """Clips, minimize/set_lr/L2 under ZeRO-2, ZeRO-3 read-back, Lamb over shards, paddle.grad, hooks,
    set_value and initializers with one shard per process (gloo), each equal to the rank's own single-process
    run."""
    _, per_rank = shared_launch.results(PROBE)
    for r, res in enumerate(per_rank):
        bad = {k: v for k, v in res.items() if v is not True}
        assert not bad, f"rank {r}: {bad}"
