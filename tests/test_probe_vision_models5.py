"""Models that are not LLMs, built from paddle's own library, trained a few steps on 2 real gloo ranks against one
process computed on the rank (one job of the shared 2-rank launch, tests/dist_scripts/vision_models5_worker.py,
models in vision_models5_cases.py): paddle.vision models under SyncBatchNorm + ``shard_dataloader`` + ZeRO-1,
ZeRO-3 / ``auto_mode="full"`` / a TP plan; paddle's Transformer layers, MultiHeadAttention and cached
decoding; LSTM / GRU / SimpleRNN; a conv / norm / pool zoo; hapi's ``paddle.Model``. In process: pooling windows
larger than the input (paddle sizes the output with C's truncating division) against paddle's own op."""
import itertools
import os

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from dist_scripts import shared_launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts", "vision_models5_worker.py")
JOB = shared_launch.job(__name__, "vision_models5", WORKER, 2, timeout=240)
FORMS = 19


@pytest.fixture(scope="module")
def ranks():
    _, got = shared_launch.results(JOB)
    assert sorted(r["rank"] for r in got) == [0, 1]
    for r in got:
        print(f"rank {r['rank']}:", {k: (v.get("err", "error"), v.get("s")) for k, v in
                                     {**r["forms"], **r["negative"]}.items()})
    return got


def test_every_form_ran_on_every_rank(ranks):
    assert all(len(r["forms"]) == FORMS for r in ranks), [sorted(r["forms"]) for r in ranks]


@pytest.mark.parametrize("i", range(FORMS))
def test_form_equals_one_process_on_real_ranks(ranks, i):
    name = sorted(ranks[0]["forms"])[i]
    for r in ranks:
        got = r["forms"][name]
        assert "error" not in got, f"{name}, rank {r['rank']}:\n{got['error']}"
        assert got["err"] <= 1.0, f"{name}, rank {r['rank']}: {got['err']:.3g} x the tolerance"


def test_negative_controls_differ_on_real_ranks(ranks):
    """squeezenet and MultiHeadAttention under data parallelism with the gradients never reduced: each rank steps
    on its own half of the batch, and the comparison with one process sees it."""
    for r in ranks:
        assert len(r["negative"]) == 2
        for name, got in r["negative"].items():
            assert "error" not in got, f"{name}, rank {r['rank']}:\n{got['error']}"
            assert got["err"] > 1.0, (name, r["rank"], got["err"])


@pytest.mark.parametrize("name", ["max_pool1d", "avg_pool1d", "max_pool2d", "avg_pool2d", "max_pool3d", "avg_pool3d"])
def test_pool_window_larger_than_the_input_sizes_the_output_as_paddle_does(name):
    """paddle's output size is (size + pads - kernel [+ stride - 1]) / stride + 1 in C's truncating division: a
    window up to a stride larger than the padded input gives one output (or none), more than that is refused.
    The batch-split op gives paddle's shape and values, and refuses where paddle refuses."""
    n, rng, seen = int(name[-2]), np.random.default_rng(0), set()
    for size, k, s, p, ceil in itertools.product([1, 2, 3], [2, 3, 4, 5], [1, 2, 3], [0, 1], [False, True]):
        if 2 * p > k:
            continue
        x = paddle.to_tensor(rng.standard_normal([4, 2] + [size] * n).astype("float32"))
        try:
            want = getattr(F, name)(x, k, s, p, ceil_mode=ceil).numpy()
        except ValueError:
            want = None
        with ap.simulate(world_size=2):
            mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
            xd = ap.shard_tensor(x, mesh, [ap.Shard(0)])
            if want is None:
                with pytest.raises(ValueError, match="larger than the input"):
                    getattr(F, name)(xd, k, s, p, ceil_mode=ceil)
                seen.add("refused")
                continue
            got = getattr(F, name)(xd, k, s, p, ceil_mode=ceil).full().numpy()
        assert got.shape == want.shape, (size, k, s, p, ceil)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=str((size, k, s, p, ceil)))
        if size + 2 * p < k:
            seen.add("clipped" if want.size else "empty")
    assert seen == {"refused", "clipped", "empty"}


def test_squeezenet_at_32_pixels_trains_data_parallel_like_one_process():
    """squeezenet1_0's last MaxPool2D(3, stride 2) sees a 2x2 map at 32 px."""
    rng = np.random.default_rng(0)
    x = paddle.to_tensor(rng.standard_normal((4, 3, 32, 32)).astype("float32"))
    y = paddle.to_tensor(rng.integers(0, 5, (4,)))

    def step(model, x, y, opt):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.full() if ap.is_dist(loss) else loss)

    paddle.seed(0)
    ref = paddle.vision.models.squeezenet1_0(num_classes=5)
    want = step(ref, x, y, paddle.optimizer.SGD(0.01, parameters=ref.parameters()))
    paddle.seed(0)
    model = paddle.vision.models.squeezenet1_0(num_classes=5)
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        ap.shard_layer(model, mesh)
        opt = ap.shard_optimizer(paddle.optimizer.SGD(0.01, parameters=model.parameters()))
        got = step(model, ap.shard_tensor(x, mesh, [ap.Shard(0)]), ap.shard_tensor(y, mesh, [ap.Shard(0)]), opt)
        params = {n: p.full().numpy() for n, p in model.named_parameters()}
    assert got == pytest.approx(want, rel=1e-5)
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(params[n], p.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)
