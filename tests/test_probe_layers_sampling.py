"""More blocks of vision / generative models on data-parallel tensors against one process (loss and every
parameter after an SGD step): a spatial transformer (affine_grid + grid_sample), unfold / fold patches,
``spectral_norm``, ``paddle.nn.SyncBatchNorm`` (against BatchNorm2D: paddle has no CPU sync kernel), an
assortment of everyday layers (LayerDict, ParameterList, tied weights, padding_idx, PReLU, Bilinear, norms over
several dims), and the refusal of a sparse embedding gradient."""
import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

import autoparallel as ap


class STN(nn.Layer):
    def __init__(self, norm):
        super().__init__()
        self.conv = nn.Conv2D(3, 4, 3, padding=1)
        self.norm = norm
        self.loc = nn.Linear(3, 6)
        self.sn = paddle.nn.utils.spectral_norm(nn.Linear(16, 5))

    def forward(self, x):
        h = self.norm(self.conv(x))
        theta = self.loc(x.mean([2, 3])).reshape([-1, 2, 3]) + paddle.to_tensor([[1.0, 0, 0], [0, 1.0, 0]])
        grid = F.affine_grid(theta, [x.shape[0], 4, 6, 6], align_corners=False)
        warped = F.grid_sample(h, grid, align_corners=False)
        patches = F.unfold(warped, 2, strides=2)                         # [N, 16, 9]
        back = F.fold(patches, [6, 6], 2, strides=2)
        return self.sn(patches.mean(2)).sum(1) + (back - warped).abs().sum([1, 2, 3])


def _run(model, x):
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    if ap.is_dist(x):
        opt = ap.shard_optimizer(opt)
    loss = (model(x) ** 2).mean()
    loss.backward()
    opt.step()
    full = lambda t: t.full().numpy() if hasattr(t, "full") else t.numpy()
    return float(loss), {n: full(p) for n, p in model.named_parameters()}


@pytest.mark.parametrize("sync", [False, True], ids=["BatchNorm2D", "SyncBatchNorm"])
def test_spatial_transformer_with_patches_and_spectral_norm_data_parallel(sync):
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((4, 3, 6, 6)).astype("float32"))
    paddle.seed(0)
    want = _run(STN(nn.BatchNorm2D(4)), x)
    paddle.seed(0)
    model = STN(nn.SyncBatchNorm(4) if sync else nn.BatchNorm2D(4))
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        ap.shard_layer(model, mesh)
        got = _run(model, ap.shard_tensor(x, mesh, [ap.Shard(0)]))
    assert got[0] == pytest.approx(want[0], rel=1e-4)
    for n, p in want[1].items():
        np.testing.assert_allclose(got[1][n], p, rtol=1e-4, atol=1e-5, err_msg=n)


def test_sparse_embedding_gradient_is_refused_by_name():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        emb = ap.shard_layer(nn.Embedding(10, 4, sparse=True), mesh)
        ids = ap.shard_tensor(paddle.to_tensor(np.arange(8).reshape(4, 2)), mesh, [ap.Shard(0)])
        with pytest.raises(NotImplementedError, match="sparse=True.*sparse=False"):
            emb(ids)


class Assorted(nn.Layer):
    """Layers users mix into small models: LayerDict, ParameterList, a weight shared by two Linears,
    Embedding(padding_idx), PReLU, Bilinear, GroupNorm / InstanceNorm2D / LayerNorm over three dims."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6, padding_idx=2)
        self.d = nn.LayerDict({"a": nn.Linear(6, 6), "b": nn.Linear(6, 6)})
        self.d["b"].weight = self.d["a"].weight
        self.ps = nn.ParameterList([self.create_parameter([6]), self.create_parameter([6, 6])])
        self.bil = nn.Bilinear(6, 6, 4)
        self.conv = nn.Conv2D(1, 4, 3, padding=1)
        self.norms = nn.Sequential(nn.GroupNorm(2, 4), nn.InstanceNorm2D(4), nn.LayerNorm([4, 4, 6]), nn.PReLU(4))

    def forward(self, ids):
        h = self.emb(ids)                                                # [N, 4, 6]
        h = self.d["b"](F.relu(self.d["a"](h) * self.ps[0])) @ self.ps[1]
        img = self.norms(self.conv(h.unsqueeze(1)))                      # [N, 4, 4, 6]
        return self.bil(h.mean(1), img.mean([1, 2]))


def test_assorted_layers_data_parallel():
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, 10, (4, 4)))
    paddle.seed(0)
    want = _run(Assorted(), ids)
    paddle.seed(0)
    model = Assorted()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        ap.shard_layer(model, mesh)
        got = _run(model, ap.shard_tensor(ids, mesh, [ap.Shard(0)]))
        assert model.d["a"].weight is model.d["b"].weight
    assert got[0] == pytest.approx(want[0], rel=1e-4)
    for n, p in want[1].items():
        np.testing.assert_allclose(got[1][n], p, rtol=1e-4, atol=1e-5, err_msg=n)
