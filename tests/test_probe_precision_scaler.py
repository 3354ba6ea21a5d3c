"""paddle.amp.GradScaler written as a paddle user writes it (auto_cast around the forward; scale/backward then
minimize, or step + update, or unscale_ + step + update) over a DP x TP model and ZeRO stages, equal a single
process that sees the same overflow: an inf in ONE data-parallel rank's batch or in ONE tensor-parallel shard of a
gradient skips the step on every rank and lowers the scale once; a bfloat16 autocast turns the scaler off as
paddle's does (no skipped step, no scale change)."""
import warnings

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as dist
from autoparallel.testing.gpu_scaler import gpu_grad_scaler
from test_probe_api_optimizers import MLP, tp_shard_fn

RNG = np.random.default_rng(0)
DATA = [(RNG.standard_normal((8, 6)).astype("float32"), RNG.standard_normal((8, 4)).astype("float32"))
        for _ in range(3)]
POISONED = 1
DATA[POISONED][0][6, 2] = 1e30                    # row 6: the second data-parallel rank's half of the batch
SCALER = dict(init_loss_scaling=2.0**15, incr_every_n_steps=2, decr_every_n_nan_or_inf=1,
              use_dynamic_loss_scaling=True)


def scaled_step(form, scaler, loss, opt, poison=None):
    scaled = scaler.scale(loss)
    scaled.backward()
    if poison is not None:
        poison()
    if form == "minimize":
        scaler.minimize(opt, scaled)
    else:
        if form == "unscale_":
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    opt.clear_grad()


def fit(model, opt, form, amp_dtype="float16", to_input=paddle.to_tensor, data=DATA, poison=None):
    scaler = gpu_grad_scaler(**SCALER)
    if to_input is not paddle.to_tensor:
        scaler = dist.shard_scaler(scaler)      # paddle's auto-parallel form (the scaler itself: found-inf is agreed)
    losses, scales = [], []
    for i, (x, y) in enumerate(data):
        with paddle.amp.auto_cast(dtype=amp_dtype):
            loss = F.mse_loss(model(to_input(x)), paddle.to_tensor(y))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scaled_step(form, scaler, loss, opt, (lambda: poison(model)) if poison and i == POISONED else None)
        losses.append(float(loss))
        scales.append(float(scaler._scale))
    params = {n: (p.full() if dist.is_dist(p) else p).numpy() for n, p in model.named_parameters()}
    return losses, scales + [scaler.is_enable()], params


def reference(form, amp_dtype="float16", data=DATA, poison=None):
    paddle.seed(3)
    m = MLP()
    return fit(m, paddle.optimizer.AdamW(0.05, parameters=m.parameters()), form, amp_dtype, data=data, poison=poison)


def distributed(form, stage=None, tp=True, amp_dtype="float16", data=DATA, poison=None):
    with dist.simulate(world_size=4):
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        paddle.seed(3)
        m = dist.shard_layer(MLP(), mesh, tp_shard_fn if tp else None)
        opt = paddle.optimizer.AdamW(0.05, parameters=m.parameters(),
                                     grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5) if form == "unscale_" else None)
        opt = dist.shard_optimizer(opt, None if stage is None else stage("dp", mesh))
        return fit(m, opt, form, amp_dtype, lambda x: dist.shard_tensor(x, mesh, [dist.Shard(0), dist.Replicate()]),
                   data, poison)


def assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert got[1] == want[1]
    for n, v in want[2].items():
        np.testing.assert_allclose(got[2][n], v, rtol=1e-5, atol=1e-6, err_msg=n, equal_nan=True)


def reference_clipped(form):
    paddle.seed(3)
    m = MLP()
    opt = paddle.optimizer.AdamW(0.05, parameters=m.parameters(), grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5))
    return fit(m, opt, form)


@pytest.mark.parametrize("form,stage,tp", [("minimize", None, True), ("step", dist.ShardingStage2, False),
                                           ("unscale_", dist.ShardingStage3, True)])
def test_an_overflow_in_one_data_parallel_batch_skips_every_rank(form, stage, tp):
    want = reference_clipped(form) if form == "unscale_" else reference(form)
    assert want[1] == [2.0**15, 2.0**14, 2.0**14, True]        # the reference skipped step 1 and halved the scale
    assert_same(distributed(form, stage, tp), want)


def test_an_inf_in_one_tensor_parallel_shard_skips_every_rank():
    def poison_full(m):                          # one process: column 5 of fc1's gradient
        a = m.fc1.weight.grad.numpy()
        a[:, 5] = np.inf
        m.fc1.weight.grad.set_value(paddle.to_tensor(a))

    def poison_shard(m):                         # rank 3 alone: its shard holds columns 4..7
        t = m.fc1.weight.locals[3].grad
        a = t.numpy()
        a[:, 1] = np.inf
        t.set_value(paddle.to_tensor(a))

    clean = [DATA[0], DATA[0], DATA[2]]
    want = reference("step", data=clean, poison=poison_full)
    assert want[1][1] == 2.0**14
    assert_same(distributed("step", dist.ShardingStage2, True, data=clean, poison=poison_shard), want)


def test_bfloat16_autocast_turns_the_scaler_off_as_paddle_does():
    want = reference("step", "bfloat16")
    assert want[1] == [2.0**15] * 3 + [False]           # paddle: no dynamic scaling for bfloat16, nothing skipped
    got = distributed("step", None, False, "bfloat16")
    assert got[1] == want[1]
    np.testing.assert_allclose(got[0][0], want[0][0], rtol=1e-5)


def test_an_overflowing_rank_keeps_its_gradient_in_the_settled_loss():
    """The loss read on every rank is reduced in the forward; a rank whose term is inf still backwards its
    own (inf) gradient, as one process does (the control: a finite batch gives one process's gradient)."""
    for big, want_inf in ((1e3, False), (1e30, True)):
        x = np.ones((4, 2), "float32")
        x[3, 0] = big
        w1 = paddle.ones([2, 1])
        w1.stop_gradient = False
        F.mse_loss(paddle.to_tensor(x) @ w1, paddle.zeros([4, 1])).backward()
        with dist.simulate(world_size=2):
            mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
            w = dist.shard_tensor(paddle.ones([2, 1]), mesh, [dist.Replicate()])
            w.stop_gradient = False
            loss = F.mse_loss(dist.shard_tensor(paddle.to_tensor(x), mesh, [dist.Shard(0)]) @ w, paddle.zeros([4, 1]))
            loss.backward()
            assert np.isinf(float(loss)) == want_inf
            for t in w.locals.values():
                np.testing.assert_allclose(t.grad.numpy(), w1.grad.numpy(), rtol=1e-6)
        assert np.isinf(w1.grad.numpy()).any() == want_inf


def test_shard_scaler_refuses_what_is_not_a_grad_scaler():
    with pytest.raises(TypeError, match="shard_scaler expects a paddle.amp.GradScaler, got AmpScaler"):
        dist.shard_scaler(paddle.amp.AmpScaler())
