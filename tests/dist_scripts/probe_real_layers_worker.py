"""Runs on every rank (4): non-LLM models of tests/test_probe_layers_ops.py on real gloo ranks, each distributed
run against the one-process run computed on the rank itself: ``paddle.vision.models.resnet18`` data parallel
over 4 with BatchNorm in train mode, two SGD steps fed by ``ap.shard_dataloader`` (losses, every parameter and
the running statistics); a channel-split conv + BatchNorm (stats replicated, or split alike); a small UNet
(Conv2DTranspose, max_unpool2d, Upsample, BatchNorm) under dp2 x tp2 with channel-parallel convs; a user PyLayer
under dp4 (its parameter's gradient counted once); a float64 CNN's gradients reduced in float64 buckets.
Reports {form: {"err", "s"} or {"error": traceback}} ("err" <= 1: equal within the tolerance)."""
from unittest import mock

import numpy as np
import paddle
from paddle import nn

import autoparallel as ap
import test_probe_layers_ops as LO
from autoparallel import local_ops
from autoparallel.testing.launch import write_result
from forms_runner import run_all
from autoparallel.testing.negative import no_gradient_reduction

world = ap.init_parallel_env()
DP4 = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])


def worst(a, b, rtol, atol) -> float:
    """Largest |a - b| / (atol + rtol |b|) (<= 1: equal within the tolerance; inf: other shapes)."""
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    if a.shape != b.shape:
        return float("inf")
    return float((np.abs(a - b) / (atol + rtol * np.abs(b))).max()) if a.size else 0.0


def compare(want, got, rtol, atol) -> float:
    """(losses, {name: parameter or buffer}) of the distributed run against one process's."""
    pairs = [(got[0], want[0])] + [(got[1][n], v) for n, v in want[1].items()]
    return max(worst(a, b, rtol, atol) for a, b in pairs)


def full(t):
    return t.full().numpy() if ap.is_dist(t) else t.numpy()


class Images(paddle.io.Dataset):
    def __init__(self, n=16, size=32):
        rng = np.random.default_rng(0)
        self.x = (rng.standard_normal((n, 3, size, size)) * 2 + 1).astype("float32")
        self.y = rng.integers(0, 5, (n, 1)).astype("int64")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def resnet_train(mesh=None):
    """resnet18 (5 classes, 32 px), two SGD steps of batch 8; the losses, parameters, running statistics and the
    eval-mode output on the last batch."""
    paddle.seed(0)
    model = paddle.vision.models.resnet18(num_classes=5)
    opt = paddle.optimizer.SGD(learning_rate=0.05, parameters=model.parameters())
    loader = paddle.io.DataLoader(Images(), batch_size=8, shuffle=False)
    if mesh is not None:
        ap.shard_layer(model, mesh)
        opt = ap.shard_optimizer(opt)
        loader = ap.shard_dataloader(loader, mesh, shard_dims="dp")
    losses = []
    for x, y in loader:
        if mesh is not None and not (ap.is_dist(x) and x.placements[0] == ap.Shard(0)):
            raise AssertionError(f"shard_dataloader's batch is not split over dp: {x}")
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(full(loss)))
    model.eval()                                  # the running statistics in use: the eval output of a batch
    state = {n: full(p) for n, p in model.named_parameters()}
    state.update({n: full(b) for n, b in model.named_buffers()})
    state["eval output"] = full(model(x))
    return losses, state


def resnet18_dp4():
    want, got = resnet_train(), resnet_train(DP4)
    assert len(got[0]) == 2 and not np.allclose(want[1]["bn1._mean"], 0)
    assert any("_mean" in n for n in want[1]) and any("_variance" in n for n in want[1])
    return compare(want, got, 5e-4, 2e-5)


def channel_split_batch_norm(split_stats):
    split, build = LO.channel_split(split_stats), LO.conv_bn
    x, loss_fn = LO._rand(4, 3, 5, 5) * 2 + 1, lambda y: (y ** 2).mean()
    paddle.seed(0)
    want = LO._step(build(), [x], loss_fn)
    paddle.seed(0)
    got = LO._step(ap.shard_layer(build(), DP4, split), [x], loss_fn)
    assert not np.allclose(want[1]["1._mean"], 0) and "1._variance" in want[1]
    return compare(want, got, 1e-4, 1e-5)


def unet_dp2_tp2():
    """LO.UNet, batch Shard(0) on dp, every conv's output channels split on tp (Conv2DTranspose: weight dim 1)."""
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])

    def split(name, layer, m):
        dim = 1 if isinstance(layer, (nn.Conv2DTranspose, nn.Conv1DTranspose)) else 0
        if isinstance(layer, (nn.Conv2D, nn.Conv2DTranspose, nn.Conv1DTranspose)):
            layer.weight = ap.shard_tensor(layer.weight, m, [ap.Replicate(), ap.Shard(dim)])
            layer.bias = ap.shard_tensor(layer.bias, m, [ap.Replicate(), ap.Shard(0)])

    x, loss_fn = LO._rand(4, 3, 8, 8), lambda y: (y ** 2).mean()
    paddle.seed(0)
    want = LO._step(LO.UNet(), [x], loss_fn)
    paddle.seed(0)
    model = ap.shard_layer(LO.UNet(), mesh, split)
    assert ap.is_dist(model.up.weight) and not model.up.weight.placements[1].is_replicated()
    got = LO._step(model, [ap.shard_tensor(x, mesh, [ap.Shard(0), ap.Replicate()])], loss_fn)
    return compare(want, got, 1e-4, 1e-5)


def pylayer_dp4(local=False):
    """LO.WithPyLayer (a batch-coupling PyLayer whose parameter is also read by a batch-split op) under dp4."""
    x, loss_fn = LO._rand(8, 6), lambda y: (y ** 2).sum()
    paddle.seed(0)
    want = LO._step(LO.WithPyLayer(), [x], loss_fn)
    paddle.seed(0)
    model = ap.shard_layer(LO.WithPyLayer(local=local), DP4)
    return compare(want, LO._step(model, [ap.shard_tensor(x, DP4, [ap.Shard(0)])], loss_fn), 1e-4, 1e-5)


def float64_dp4():
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((8, 3, 6, 6)))
    build = lambda: nn.Sequential(nn.Conv2D(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(64, 3))  # noqa: E731
    loss_fn = lambda y: (y ** 2).mean()  # noqa: E731
    paddle.set_default_dtype("float64")
    try:
        paddle.seed(0)
        want = LO._step(build(), [x], loss_fn)
        paddle.seed(0)
        got = LO._step(ap.shard_layer(build(), DP4), [ap.shard_tensor(x, DP4, [ap.Shard(0)])], loss_fn)
    finally:
        paddle.set_default_dtype("float32")
    bad = [n for n, p in got[1].items() if p.dtype != np.float64]
    if bad:
        raise AssertionError(f"not float64 after the step: {bad}")
    return compare(want, got, 1e-12, 1e-14)


def batch_norm_cnn_dp4():
    """conv + BatchNorm2D (train) + linear under dp4, one SGD step: the running mean / variance only."""
    build = LO.conv_bn
    x, loss_fn = LO._rand(8, 3, 5, 5) * 2 + 1, lambda y: (y ** 2).mean()
    paddle.seed(0)
    want = LO._step(build(), [x], loss_fn)
    paddle.seed(0)
    got = LO._step(ap.shard_layer(build(), DP4), [ap.shard_tensor(x, DP4, [ap.Shard(0)])], loss_fn)
    stats = {n: v for n, v in want[1].items() if n in ("1._mean", "1._variance")}
    assert len(stats) == 2 and not np.allclose(stats["1._mean"], 0)
    return compare((got[0], stats), got, 1e-4, 1e-5)


def local_statistics(fn):
    """``fn`` with BatchNorm's statistics taken over each rank's shard of the batch (the sums not all-reduced)."""
    with mock.patch.object(local_ops, "_stat_sum", lambda xs, mesh, dims: xs), \
            mock.patch.object(local_ops, "_mesh_reduce", lambda xs, mesh, dims: xs):
        return fn()


def unreduced(fn):
    with no_gradient_reduction():
        return fn()


FORMS = {
    "resnet18 BatchNorm train, shard_dataloader, 2 SGD steps / dp4": resnet18_dp4,
    "conv channel split + BatchNorm stats replicated / 4": lambda: channel_split_batch_norm(False),
    "conv channel split + BatchNorm stats split / 4": lambda: channel_split_batch_norm(True),
    "UNet Conv2DTranspose, channel-parallel convs / dp2 x tp2": unet_dp2_tp2,
    "user PyLayer, parameter read twice / dp4": pylayer_dp4,
    "float64 CNN, float64 buckets / dp4": float64_dp4,
    "small CNN BatchNorm running statistics / dp4": batch_norm_cnn_dp4,
}
NEGATIVE = {                                     # {control: err} (expected > 1)
    "float64 CNN without gradient reduction / dp4": lambda: unreduced(float64_dp4),
    "PyLayer run per batch shard / dp4": lambda: pylayer_dp4(local=True),
    "BatchNorm statistics of each rank's shard / dp4": lambda: local_statistics(batch_norm_cnn_dp4),
}




write_result({"rank": world.rank, "forms": run_all(FORMS), "negative": run_all(NEGATIVE)})
