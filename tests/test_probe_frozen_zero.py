"""Frozen parameters under DP and ZeRO 1-3 (a LoRA-shaped model: frozen base Linears, small adapters): they get
no master chunk (stages 1/2), no moments and no gradient-bucket slot; a parameter unfrozen at step 2 gets its
state then and trains as in one process; one frozen at step 3 leaves the buckets at that step; checkpoints
round-trip both. Bytes per rank are checked against a hand count; the negative control (nothing frozen)
counts every parameter's chunk, so the count would see a frozen master chunk."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as ap
from autoparallel.checkpoint.state import training_state
from autoparallel.testing.lora import HandLoRA

RNG = np.random.default_rng(0)
XS = [RNG.standard_normal((8, 16)).astype("float32") for _ in range(5)]
YS = [RNG.standard_normal((8, 16)).astype("float32") for _ in range(5)]
N, R = 16, 2                    # base Linear [16, 16] + bias [16]; adapters A [16, 2], B [2, 16]


class LoRA(HandLoRA):
    def __init__(self, r=R):
        super().__init__(N, r, a_std=0.2, b_std=0.2)     # B not zero: the adapters' gradients are not trivially zero


class Net(nn.Layer):
    def __init__(self):
        super().__init__()
        self.a, self.b = LoRA(), LoRA()

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


def freeze(layer, frozen=True):
    layer.lora_A.stop_gradient = layer.lora_B.stop_gradient = frozen


def build(stage, frozen_b=True):
    """Net with ``b``'s adapters frozen; stage None: one process, 0: DP4, 1-3: ZeRO over 4 data ranks."""
    paddle.seed(0)
    m = Net()
    freeze(m.b, frozen_b)
    opt = paddle.optimizer.AdamW(1e-2, parameters=m.parameters())
    if stage is not None:
        s = ap.Strategy()
        s.data_parallel.degree = 4
        if stage:
            s.sharding.enable, s.sharding.stage = True, stage
        m, opt = ap.parallelize(m, opt, strategy=s)
    return m, opt


def train_step(m, opt, i):
    if i == 1:
        freeze(m.b, False)                  # unfrozen at step 2
    if i == 2:
        m.a.lora_A.stop_gradient = True     # frozen at step 3
    loss = F.mse_loss(m(paddle.to_tensor(XS[i])), paddle.to_tensor(YS[i]))
    loss.backward()
    opt.step()
    opt.clear_grad()
    return float(loss)


def values(m):
    return {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in m.named_parameters()}


def bucketed(opt) -> set:
    if hasattr(opt, "_bucketed"):
        return {n for n, p in opt.model.named_parameters() if id(p) in opt._bucketed}
    return {p.name for b in opt.grad_sync.buckets for p in b.params}


@pytest.fixture(scope="module")
def one_process():
    m, opt = build(None)
    start = values(m)
    return [train_step(m, opt, i) for i in range(3)], start, values(m)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unfrozen_at_step_2_and_frozen_at_step_3_equal_one_process(stage, one_process):
    want_losses, start, want = one_process
    with ap.simulate(world_size=4):
        m, opt = build(stage)
        losses = [train_step(m, opt, 0)]
        if stage:
            assert bucketed(opt) == {"a.lora_A", "a.lora_B"}
        losses += [train_step(m, opt, i) for i in (1, 2)]
        got = values(m)
        names = {n: p.name for n, p in m.named_parameters()}
        left = bucketed(opt)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for n, v in want.items():
        np.testing.assert_allclose(got[n], v, rtol=1e-5, atol=1e-6, err_msg=n)
        if "base" in n:
            np.testing.assert_array_equal(got[n], start[n], err_msg=f"frozen {n} moved")
    assert not np.allclose(got["b.lora_B"], start["b.lora_B"]), "the unfrozen adapter did not train"
    trainable = {"a.lora_B", "b.lora_A", "b.lora_B"}                    # a.lora_A frozen at step 3
    assert left == (trainable if stage else {names[n] for n in trainable})


def chunk(n):
    return -(-n // 4)           # rank 0's ceil-division chunk over 4 data ranks


def hand_count(stage, trainable, frozen) -> dict:
    """Rank 0's bytes after a step (float32): AdamW keeps moment1/2 per chunk and two [1] beta powers."""
    states = sum(3 * 4 * chunk(n) + 2 * 4 for n in trainable)          # master + 2 moments + beta powers
    whole = 4 * sum(trainable + frozen)
    if stage == 3:
        return {"params": 4 * sum(chunk(n) for n in trainable + frozen), "grads": 0,
                "optimizer_states": states - 4 * sum(chunk(n) for n in trainable)}
    return {"params": whole, "grads": 4 * sum(trainable) if stage == 1 else 0, "optimizer_states": states}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_per_rank_count_only_trainable_parameters(stage):
    adapters, base = [N * R, R * N] * 2, [N * N, N] * 2
    with ap.simulate(world_size=4):
        m, opt = build(stage, frozen_b=False)
        freeze(m.b, False)
        train_step(m, opt, 3)
        assert opt.memory_bytes(0) == hand_count(stage, adapters, base)
        assert sum(len(d) for d in opt.master.values()) == 4 * (4 if stage < 3 else 8)
        # negative control: nothing frozen -- every parameter's chunk, moments and bucket slot are counted
        m, opt = build(stage, frozen_b=False)
        for p in m.parameters():
            p.stop_gradient = False
        train_step(m, opt, 3)
        assert opt.memory_bytes(0) == hand_count(stage, adapters + base, [])


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_checkpoint_round_trips_frozen_and_unfrozen_parameters(stage, tmp_path):
    with ap.simulate(world_size=4):
        m, opt = build(stage)
        want = [train_step(m, opt, i) for i in range(5)][3:]
        m, opt = build(stage)
        train_step(m, opt, 0)
        state = training_state(m, opt)                   # b's adapters frozen: no optimizer state
        assert "b.lora_A" not in state["optimizer"] and "moment1" in state["optimizer"]["a.lora_A"]
        ap.save_state_dict(state, str(tmp_path / "frozen"))
        m, opt = build(stage)                            # a fresh run: b frozen, then unfrozen at step 2
        ap.load_state_dict(training_state(m, opt), str(tmp_path / "frozen"))
        for i in (1, 2):
            train_step(m, opt, i)
        state = training_state(m, opt)                   # b trained: its state is saved
        assert "moment1" in state["optimizer"]["b.lora_B"]
        ap.save_state_dict(state, str(tmp_path / "unfrozen"))
        m, opt = build(stage)
        freeze(m.b, False)                               # trainable as saved: its state is named and loaded
        ap.load_state_dict(training_state(m, opt), str(tmp_path / "unfrozen"))
        m.a.lora_A.stop_gradient = True                  # frozen at step 3, as in the uninterrupted run
        got = [train_step(m, opt, i) for i in (3, 4)]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def grouped(stage):
    """AdamW with parameter groups; b's group (its own learning rate and decay) is wholly frozen when sharded."""
    paddle.seed(0)
    m = Net()
    freeze(m.b)
    opt = paddle.optimizer.AdamW(1e-2, parameters=[
        {"params": [m.a.lora_A, m.a.lora_B, m.a.base.weight]},
        {"params": [m.b.lora_A, m.b.lora_B], "learning_rate": 0.3, "weight_decay": 0.5},
        {"params": [m.b.base.weight, m.b.base.bias, m.a.base.bias]}])
    if stage is not None:
        s = ap.Strategy()
        s.data_parallel.degree = 4
        s.sharding.enable, s.sharding.stage = True, stage
        m, opt = ap.parallelize(m, opt, strategy=s)
    losses = []
    for i in range(3):
        if i == 1:
            freeze(m.b, False)
        loss = F.mse_loss(m(paddle.to_tensor(XS[i])), paddle.to_tensor(YS[i]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, values(m)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_group_frozen_when_sharded_trains_with_its_own_settings_once_unfrozen(stage):
    want = grouped(None)
    with ap.simulate(world_size=4):
        got = grouped(stage)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for n, v in want[1].items():
        np.testing.assert_allclose(got[1][n], v, rtol=1e-5, atol=1e-6, err_msg=n)


class HalfLoRA(LoRA):
    """A bf16 frozen base (read through a cast: CPU paddle has no bf16 matmul), fp32 adapters."""

    def __init__(self):
        super().__init__()
        self.base.to(dtype="bfloat16")

    def forward(self, x):
        return F.linear(x, self.base.weight.astype("float32"), self.base.bias.astype("float32")) + \
            x @ self.lora_A @ self.lora_B


def half_run(stage):
    paddle.seed(0)
    m = Net()
    m.a, m.b = HalfLoRA(), HalfLoRA()
    freeze(m.b)
    opt = paddle.optimizer.AdamW(1e-2, parameters=m.parameters())
    if stage is not None:
        s = ap.Strategy()
        s.data_parallel.degree = 4
        s.sharding.enable, s.sharding.stage = True, stage
        m, opt = ap.parallelize(m, opt, strategy=s)
    losses = [train_step(m, opt, i) for i in (0, 1)]
    got = {n: (p.full() if ap.is_dist(p) else p).astype("float32").numpy() for n, p in m.named_parameters()}
    return losses, got, (opt.memory_bytes(0)["params"] if stage else None)


def test_zero3_keeps_a_frozen_bf16_chunk_in_bf16():
    want = half_run(None)
    with ap.simulate(world_size=4):
        got = half_run(3)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for n, v in want[1].items():
        np.testing.assert_allclose(got[1][n], v, rtol=1e-5, atol=1e-6, err_msg=n)
    # frozen bf16 base chunks 2 B per element, the fp32 adapters' (b's unfrozen at step 2) 4 B
    assert got[2] == 2 * 2 * (chunk(N * N) + chunk(N)) + 4 * 4 * chunk(N * R)


def split_run(dist):
    """``shard_optimizer(opt, mesh)`` with a weight already sharded on the data dim (the article's form: a
    SplitOptimizer); the last Linear's weight frozen when sharded, unfrozen at step 2."""
    paddle.seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model[2].weight.stop_gradient = True
    opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
    if dist:
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])

        def shard_fn(name, layer, pm):
            if name == "0":
                layer.weight = ap.shard_tensor(layer.weight, pm, [ap.Shard(1), ap.Replicate()])
            return layer
        model = ap.shard_layer(model, mesh, shard_fn)
        opt = ap.shard_optimizer(opt, mesh)
        assert type(opt).__name__ == "SplitOptimizer"
    losses = []
    for i in range(3):
        model[2].weight.stop_gradient = i == 0
        loss = (model(paddle.to_tensor(XS[i][:, :8])) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, [(p.full() if ap.is_dist(p) else p).numpy() for p in model.parameters()]


def test_split_optimizer_trains_a_parameter_unfrozen_later():
    want = split_run(False)
    with ap.simulate(world_size=4):
        got = split_run(True)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
