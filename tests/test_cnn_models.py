"""Ordinary CNN code (paddle.nn.Conv2D / Conv3D layers, pooling, norms, Flatten, a loss layer) runs data-parallel
on distributed tensors like one process: values, gradients and SGD steps."""
import numpy as np
import paddle
import pytest

import autoparallel as ap


class SmallCNN(paddle.nn.Layer):
    def __init__(self, norm: str, padding_mode: str = "zeros"):
        super().__init__()
        self.conv1 = paddle.nn.Conv2D(3, 8, 3, padding=1, padding_mode=padding_mode)
        self.norm = {"batch": paddle.nn.BatchNorm2D(8), "group": paddle.nn.GroupNorm(2, 8),
                     "none": paddle.nn.Identity()}[norm]
        self.pool = paddle.nn.MaxPool2D(2)
        self.conv2 = paddle.nn.Conv2D(8, 8, 3, stride=2, groups=2)
        self.head = paddle.nn.Sequential(paddle.nn.Flatten(), paddle.nn.Linear(8, 5))

    def forward(self, x):
        h = self.pool(paddle.nn.functional.relu(self.norm(self.conv1(x))))
        h = paddle.nn.functional.adaptive_avg_pool2d(self.conv2(h), 1)
        return self.head(h)


def _train(model, x, y, steps, mesh=None):
    opt = paddle.optimizer.SGD(learning_rate=0.05, parameters=model.parameters())
    loss_fn = paddle.nn.CrossEntropyLoss()
    if mesh is not None:
        opt = ap.shard_optimizer(opt)
    out = []
    for _ in range(steps):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        out.append(float(loss.full().numpy()) if hasattr(loss, "full") else float(loss))
    return out


@pytest.mark.parametrize("norm,padding_mode", [("none", "zeros"), ("group", "reflect"), ("batch", "zeros")])
def test_small_cnn_data_parallel_equals_one_process(norm, padding_mode):
    rng = np.random.default_rng(0)
    x = paddle.to_tensor(rng.standard_normal((8, 3, 8, 8)).astype("float32"))
    y = paddle.to_tensor(rng.integers(0, 5, (8,)).astype("int64"))
    paddle.seed(0)
    ref = _train(SmallCNN(norm, padding_mode), x, y, 3)
    paddle.seed(0)
    model = SmallCNN(norm, padding_mode)
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        ap.shard_layer(model, mesh)
        got = _train(model, ap.shard_tensor(x, mesh, [ap.Shard(0)]), ap.shard_tensor(y, mesh, [ap.Shard(0)]), 3,
                     mesh)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert got[-1] != got[0]


def test_conv3d_layer_and_input_keyword():
    paddle.seed(0)
    conv = paddle.nn.Conv3D(2, 4, 3, padding=1)
    x = paddle.randn([2, 2, 4, 4, 4])
    want = conv(x).numpy()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        got = conv(input=ap.shard_tensor(x, mesh, [ap.Shard(0)])).full().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_batch_norm_statistics_and_eval_after_data_parallel_training():
    """Sync batch norm: the running mean/var every rank keeps, and the eval-mode output, equal one process's."""
    rng = np.random.default_rng(1)
    x = paddle.to_tensor(rng.standard_normal((8, 3, 6, 6)).astype("float32") * 2 + 1)
    y = paddle.to_tensor(rng.integers(0, 5, (8,)).astype("int64"))
    paddle.seed(0)
    ref_model = SmallCNN("batch")
    _train(ref_model, x, y, 2)
    ref_model.eval()
    want_eval = ref_model(x).numpy()
    paddle.seed(0)
    model = SmallCNN("batch")
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "x"])
        ap.shard_layer(model, mesh)
        _train(model, ap.shard_tensor(x, mesh, [ap.Shard(0), ap.Shard(2)]),
               ap.shard_tensor(y, mesh, [ap.Shard(0), ap.Replicate()]), 2, mesh)
        for name in ("_mean", "_variance"):
            buf = getattr(model.norm, name)
            locals_ = buf.locals.values() if hasattr(buf, "locals") else [buf]
            for t in locals_:
                np.testing.assert_allclose(t.numpy(), getattr(ref_model.norm, name).numpy(), rtol=1e-5, atol=1e-6)
        model.eval()
        got_eval = model(ap.shard_tensor(x, mesh, [ap.Shard(0), ap.Replicate()])).full().numpy()
    np.testing.assert_allclose(got_eval, want_eval, rtol=1e-4, atol=1e-5)
