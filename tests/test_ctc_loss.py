"""``F.ctc_loss`` / ``paddle.nn.CTCLoss`` on distributed log-probabilities (autoparallel/local_ctc.py): the loss
and the logits' gradient equal one process's for every reduction, ``zero_infinity`` and ``norm_by_times``, with
the batch split unevenly, the time or class dim split (gathered first), on a 2-D mesh, and in a small CTC
acoustic model trained under ``parallelize``."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap

T, B, C, L = 6, 5, 5, 3


def _data(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((T, B, C)).astype("float32")
    labels = paddle.to_tensor(rng.integers(1, C, (B, L)).astype("int32"))
    il = paddle.to_tensor(np.array([6, 5, 6, 4, 2], dtype="int64"))
    ll = paddle.to_tensor(np.array([3, 2, 1, 3, 2], dtype="int64"))     # sample 4: 2 frames for "x y" -> inf
    return logits, labels, il, ll


def _loss(logits, labels, il, ll, **kw):
    return F.ctc_loss(F.log_softmax(logits, axis=-1), labels, il, ll, **kw)


@pytest.mark.parametrize("kw", [{"reduction": "mean", "zero_infinity": True}, {"reduction": "sum", "zero_infinity": True},
                                {"reduction": "none"}, {"reduction": "mean", "norm_by_times": True,
                                                        "zero_infinity": True}], ids=str)
@pytest.mark.parametrize("mesh_shape,placements", [([2], ["S1"]), ([2], ["S0"]), ([2, 2], ["S1", "S2"]),
                                                   ([2, 2], ["S1", "R"])], ids=str)
def test_ctc_loss_on_distributed_log_probs_equals_one_process(kw, mesh_shape, placements):
    logits, labels, il, ll = _data()
    x = paddle.to_tensor(logits, stop_gradient=False)
    want = _loss(x, labels, il, ll, **kw)
    want.sum().backward()
    want, want_grad = want.numpy(), x.grad.numpy()
    pl = [ap.Shard(int(p[1])) if p[0] == "S" else ap.Replicate() for p in placements]
    with ap.simulate(world_size=int(np.prod(mesh_shape))):
        mesh = ap.ProcessMesh(np.arange(np.prod(mesh_shape)).reshape(mesh_shape).tolist(),
                              dim_names=["dp", "tp"][:len(mesh_shape)])
        xd = ap.shard_tensor(paddle.to_tensor(logits), mesh, pl, stop_gradient=False)
        got = _loss(xd, labels, il, ll, **kw)
        got.sum().backward()
        got, grad = got.full().numpy(), xd.grad.full().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)


def test_mean_is_over_the_whole_uneven_batch_not_a_mean_of_rank_means():
    """Negative control: the 3 + 2 split's two per-rank means averaged differ from the global mean."""
    logits, labels, il, ll = _data()
    per = _loss(paddle.to_tensor(logits), labels, il, ll, reduction="none").numpy() / ll.numpy()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        got = float(_loss(ap.shard_tensor(paddle.to_tensor(logits), mesh, [ap.Shard(1)]), labels, il, ll))
    assert got == pytest.approx(per.mean(), rel=1e-6)
    assert abs((per[:3].mean() + per[3:].mean()) / 2 - per.mean()) > 1e-3


class CTCModel(paddle.nn.Layer):
    """Frames -> GRU -> per-frame class scores, trained with paddle.nn.CTCLoss (time-major log-probs)."""

    def __init__(self):
        super().__init__()
        self.rnn = paddle.nn.GRU(4, 8)
        self.proj = paddle.nn.Linear(8, C)
        self.ctc = paddle.nn.CTCLoss(blank=0, reduction="mean")

    def forward(self, frames, labels, il, ll):
        out, _ = self.rnn(frames)
        lp = F.log_softmax(self.proj(out), axis=-1).transpose([1, 0, 2])
        return self.ctc(lp, labels, il, ll)


def test_ctc_acoustic_model_trains_like_one_process_under_parallelize():
    _, labels, il, ll = _data()
    il = paddle.to_tensor(np.array([6, 5, 6, 4, 6], dtype="int64"))
    rng = np.random.default_rng(4)
    frames, labels, il, ll = (paddle.to_tensor(rng.standard_normal((4, T, 4)).astype("float32")), labels[:4],
                              il[:4], ll[:4])

    def train(model, opt):
        losses = []
        for _ in range(3):
            loss = model(frames, labels, il, ll)
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
        return losses

    paddle.seed(0)
    ref = CTCModel()
    want = train(ref, paddle.optimizer.Adam(0.01, parameters=ref.parameters()))
    s = ap.Strategy()
    s.data_parallel.degree = 2
    with ap.simulate(world_size=2):
        paddle.seed(0)
        model = CTCModel()
        model, opt = ap.parallelize(model, paddle.optimizer.Adam(0.01, parameters=model.parameters()), strategy=s)
        got = train(model, opt)
        params = {n: p.full().numpy() for n, p in model.named_parameters()}
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(params[n], p.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)
