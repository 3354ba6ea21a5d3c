"""Building blocks of ordinary non-LLM models on distributed tensors, against one process (loss and every
parameter after an SGD step): a small UNet (Conv2DTranspose, Upsample, MaxPool with return_mask and
max_unpool2d, concat skips, BatchNorm), conv layers whose parameters are distributed fed a plain tensor,
``paddle.nn.utils.weight_norm``, and a user's PyLayer (gathered, run whole; the per-shard run is the negative
control)."""
import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

import autoparallel as ap

LR = 0.5


class UNet(nn.Layer):
    def __init__(self):
        super().__init__()
        self.down = nn.Sequential(nn.Conv2D(3, 8, 3, padding=1), nn.BatchNorm2D(8), nn.ReLU())
        self.pool = nn.MaxPool2D(2, return_mask=True)
        self.mid = nn.Conv2D(8, 8, 3, padding=1)
        self.up = nn.Conv2DTranspose(8, 4, 2, stride=2)
        self.up1d = nn.Conv1DTranspose(3, 2, 3, stride=2, padding=1, output_padding=1)
        self.resize = nn.Upsample(scale_factor=2, mode="bilinear")
        self.out = nn.Conv2D(8 + 4 + 8 + 8, 2, 1)

    def forward(self, x):
        a = self.down(x)
        p, mask = self.pool(a)
        m = self.mid(p)
        skip = F.max_unpool2d(m, mask, 2)
        h = paddle.concat([a, self.up(m), skip, self.resize(m)], axis=1)
        return self.out(h).mean(1) + self.up1d(x.mean(2)).mean([1, 2])[:, None, None]


class Centre(paddle.autograd.PyLayer):
    """Couples the batch: x minus its mean over dim 0, times w (written for whole tensors)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w, x)
        return (x - x.mean(0, keepdim=True)) * w

    @staticmethod
    def backward(ctx, g):
        w, x = ctx.saved_tensor()
        gx = g * w
        return gx - gx.mean(0, keepdim=True), ((x - x.mean(0, keepdim=True)) * g).sum(0)


class WithPyLayer(nn.Layer):
    def __init__(self, local=False):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.w = self.create_parameter([6], default_initializer=nn.initializer.Uniform(0.5, 1.5))
        self.local = local

    def forward(self, x):
        h = self.fc(x)
        if self.local and ap.is_dist(h):        # the negative control: the PyLayer on each rank's shard of the batch
            return ap.local_map(Centre.apply, [[ap.Shard(0)]])(h, self.w) + h * self.w
        return Centre.apply(h, self.w) + h * self.w      # w also read by a batch-split op: one gradient


class WeightNormed(nn.Layer):
    def __init__(self):
        super().__init__()
        self.conv = paddle.nn.utils.weight_norm(nn.Conv2D(3, 4, 3), dim=0)
        self.fc = paddle.nn.utils.weight_norm(nn.Linear(4, 3))

    def forward(self, x):
        return self.fc(self.conv(x).mean([2, 3]))


def _step(model, inputs, loss_fn):
    opt = paddle.optimizer.SGD(learning_rate=LR, parameters=model.parameters())
    if any(ap.is_dist(p) for p in model.parameters()):
        opt = ap.shard_optimizer(opt)
    loss = loss_fn(model(*inputs))
    loss.backward()
    opt.step()
    full = lambda t: t.full().numpy() if hasattr(t, "full") else t.numpy()
    return float(loss), {n: full(p) for n, p in model.named_parameters()}


def _compare(build, inputs, loss_fn, placements, shard_fn=None, world=2, rtol=1e-4):
    paddle.seed(0)
    want = _step(build(), inputs, loss_fn)
    paddle.seed(0)
    model = build()
    with ap.simulate(world_size=world):
        mesh = ap.ProcessMesh(list(range(world)), dim_names=["dp"])
        ap.shard_layer(model, mesh, shard_fn)
        xs = [ap.shard_tensor(x, mesh, p) if p is not None else x for x, p in zip(inputs, placements)]
        got = _step(model, xs, loss_fn)
    return want, got


def _assert_same(want, got, rtol=1e-4, atol=1e-5):
    assert got[0] == pytest.approx(want[0], rel=rtol, abs=atol)
    for n, p in want[1].items():
        np.testing.assert_allclose(got[1][n], p, rtol=rtol, atol=atol, err_msg=n)


def _rand(*shape, seed=0):
    return paddle.to_tensor(np.random.default_rng(seed).standard_normal(shape).astype("float32"))


def test_unet_with_transposed_convs_unpooling_and_upsampling_data_parallel():
    want, got = _compare(UNet, [_rand(4, 3, 8, 8)], lambda y: (y ** 2).mean(), [[ap.Shard(0)]])
    _assert_same(want, got)


def test_conv_layers_with_distributed_parameters_take_a_plain_input():
    """Output channels split (weight Shard(0), bias Shard(0)); the input stays an ordinary tensor."""
    def split_channels(name, layer, mesh):
        if isinstance(layer, nn.Conv2D):
            layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(0)])
            layer.bias = ap.shard_tensor(layer.bias, mesh, [ap.Shard(0)])

    build = lambda: nn.Sequential(nn.Conv2D(3, 4, 3, padding=1, padding_mode="reflect"), nn.ReLU(),
                                  nn.Conv2DTranspose(4, 2, 2, stride=2))
    want, got = _compare(build, [_rand(2, 3, 5, 5)], lambda y: (y ** 2).mean(), [None], split_channels)
    _assert_same(want, got)


def test_weight_norm_data_parallel():
    want, got = _compare(WeightNormed, [_rand(4, 3, 5, 5)], lambda y: (y ** 2).mean(), [[ap.Shard(0)]])
    _assert_same(want, got)
    assert {"conv.weight_g", "conv.weight_v", "fc.weight_g"} <= set(want[1])


def test_user_pylayer_runs_on_the_whole_batch_and_per_shard_differs():
    x = _rand(4, 6)
    loss_fn = lambda y: (y ** 2).sum()
    want, got = _compare(WithPyLayer, [x], loss_fn, [[ap.Shard(0)]])
    _assert_same(want, got)
    _, local = _compare(lambda: WithPyLayer(local=True), [x], loss_fn, [[ap.Shard(0)]])
    assert abs(local[0] - want[0]) > 1e-3 * abs(want[0])        # centring per shard is another function


class LegacyNorm(nn.Layer):
    """paddle.nn.BatchNorm (DenseNet's, with a fused act) next to BatchNorm2D."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2D(3, 4, 3)
        self.bn = nn.BatchNorm(4, act="relu")
        self.bn2 = nn.BatchNorm2D(4)

    def forward(self, x):
        return self.bn2(self.bn(self.conv(x))).mean([2, 3])


def test_legacy_batch_norm_layer_trains_and_evaluates_like_one_process():
    x = _rand(4, 3, 6, 6) * 2 + 1
    loss_fn = lambda y: ((y - 0.3) ** 2).mean()
    paddle.seed(0)
    ref = LegacyNorm()
    want = _step(ref, [x], loss_fn)
    ref.eval()
    want_eval = ref(x).numpy()
    paddle.seed(0)
    model = LegacyNorm()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        ap.shard_layer(model, mesh)
        xs = ap.shard_tensor(x, mesh, [ap.Shard(0)])
        got = _step(model, [xs], loss_fn)
        stats = {n: b.full().numpy() if hasattr(b, "full") else b.numpy() for n, b in model.named_buffers()}
        model.eval()
        got_eval = model(xs).full().numpy()
    _assert_same(want, got)
    for n, b in ref.named_buffers():
        np.testing.assert_allclose(stats[n], b.numpy(), rtol=1e-5, atol=1e-6, err_msg=n)
    np.testing.assert_allclose(got_eval, want_eval, rtol=1e-4, atol=1e-5)
    assert not np.allclose(ref.bn._mean.numpy(), 0)             # the statistics moved


def test_float64_model_gradients_are_reduced_in_float64():
    """A float64 model's data-parallel gradients equal one process's to float64 rounding (the reduction
    buckets once summed them in float32: 1e-8 relative errors)."""
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((4, 3, 6, 6)))
    build = lambda: nn.Sequential(nn.Conv2D(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(64, 3))
    loss_fn = lambda y: (y ** 2).mean()
    paddle.set_default_dtype("float64")
    try:
        want, got = _compare(build, [x], loss_fn, [[ap.Shard(0)]])
    finally:
        paddle.set_default_dtype("float32")
    assert want[1]["0.weight"].dtype == np.float64
    _assert_same(want, got, rtol=1e-12, atol=1e-14)


def conv_bn():
    return nn.Sequential(nn.Conv2D(3, 4, 3), nn.BatchNorm2D(4), nn.ReLU(), nn.Flatten(), nn.Linear(36, 2))


def channel_split(split_stats):
    """A shard function: Conv2D output channels split; BatchNorm2D's affine parameters and running statistics
    split alike when ``split_stats``, else left replicated."""
    def split(name, layer, mesh):
        if isinstance(layer, nn.Conv2D):
            layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(0)])
            layer.bias = ap.shard_tensor(layer.bias, mesh, [ap.Shard(0)])
        if isinstance(layer, nn.BatchNorm2D) and split_stats:
            for attr in ("weight", "bias", "_mean", "_variance"):
                setattr(layer, attr, ap.shard_tensor(getattr(layer, attr), mesh, [ap.Shard(0)]))
    return split


@pytest.mark.parametrize("split_stats", [False, True], ids=["stats-replicated", "stats-split"])
def test_channel_parallel_conv_then_batch_norm_keeps_the_running_statistics(split_stats):
    """Conv2D output channels split; BatchNorm2D's running mean / variance either replicated (x's channels are
    gathered: a split copy of the stats would be updated and lost) or split alike (updated in place)."""
    want, got = _compare(conv_bn, [_rand(4, 3, 5, 5) * 2 + 1], lambda y: (y ** 2).mean(), [None],
                         channel_split(split_stats))
    _assert_same(want, got)
    assert not np.allclose(want[1]["1._mean"], 0)            # the statistics moved (compared above)
