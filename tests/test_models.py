"""Example models (examples/models): shapes, training signal, causality, GQA, tying, lazy build, references."""

import numpy as np
import paddle
import pytest

from examples.models import GPT, PRESETS, GPTConfig, Llama, LlamaConfig, build, initialize_lazy  # noqa: E402
from examples.models.llama import RMSNorm, apply_rotary, rotary_tables  # noqa: E402

TINY_GPT = dict(vocab_size=64, hidden=32, layers=2, heads=4, max_positions=16)
TINY_LLAMA = dict(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, max_positions=16)


def make(kind, seed=0, **overrides):
    paddle.seed(seed)
    if kind == "gpt":
        return GPT(GPTConfig(**{**TINY_GPT, **overrides}))
    return Llama(LlamaConfig(**{**TINY_LLAMA, **overrides}))


def batch(seed=1, b=2, t=8, vocab=64):
    rng = np.random.default_rng(seed)
    return paddle.to_tensor(rng.integers(0, vocab, (b, t)), dtype="int64")


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_forward_shape_and_loss(kind):
    model = make(kind)
    ids = batch()
    logits = model(ids)
    assert list(logits.shape) == [2, 8, 64]
    loss = model.loss(logits, batch(seed=2))
    assert loss.shape == [] and np.isfinite(float(loss))
    assert abs(float(loss) - np.log(64)) < 0.5          # small init: close to uniform


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_loss_decreases_with_adamw(kind):
    model = make(kind)
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    ids, labels = batch(), batch(seed=2)
    losses = []
    for _ in range(8):
        loss = model.loss(model(ids), labels)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_causal_mask_is_real(kind):
    model = make(kind)
    model.eval()
    ids = batch()
    changed = ids.numpy().copy()
    changed[:, 5] = (changed[:, 5] + 1) % 64
    a = model(ids).numpy()
    b = model(paddle.to_tensor(changed)).numpy()
    np.testing.assert_allclose(a[:, :5], b[:, :5], rtol=1e-6, atol=1e-6)
    assert np.abs(a[:, 5:] - b[:, 5:]).max() > 1e-4     # later positions do see the change


def test_gqa_equals_mha_with_repeated_kv_weights():
    gqa = make("llama", kv_heads=2)
    mha = make("llama", kv_heads=4)
    hd, n = 32 // 4, 2
    state = {}
    for name, p in gqa.named_parameters():
        w = p.numpy()
        if name.endswith(("k_proj.weight", "v_proj.weight")):     # [hidden, kv*hd] -> [hidden, h*hd]
            w = np.repeat(w.reshape(32, 2, 1, hd), n, axis=2).reshape(32, 4 * hd)
        state[name] = w
    mha.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
    ids = batch()
    np.testing.assert_allclose(gqa(ids).numpy(), mha(ids).numpy(), rtol=1e-5, atol=1e-6)
    assert gqa.num_parameters() < mha.num_parameters()


@pytest.mark.parametrize("kind,embed", [("gpt", "wte"), ("llama", "embed_tokens")])
def test_tied_embeddings_share_the_parameter(kind, embed):
    tied, untied = make(kind, tie_embeddings=True), make(kind)
    names = [n for n, _ in tied.named_parameters()]
    assert not any(n.startswith("lm_head") for n in names)
    assert untied.num_parameters() - tied.num_parameters() == 64 * 32
    loss = tied.loss(tied(batch()), batch(seed=2))
    loss.backward()
    weight = getattr(tied, embed).weight
    # the head's contribution reaches every vocabulary row, not only the rows looked up
    assert np.all(np.abs(weight.grad.numpy()).sum(axis=1) > 0)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_lazy_build_then_initialize_matches_eager(kind):
    eager = make(kind, seed=7)
    paddle.seed(7)
    with paddle.LazyGuard():
        lazy = GPT(GPTConfig(**TINY_GPT)) if kind == "gpt" else Llama(LlamaConfig(**TINY_LLAMA))
    assert not any(p._is_initialized() for p in lazy.parameters())
    assert lazy.num_parameters() == eager.num_parameters()
    initialize_lazy(lazy)
    for (n1, p1), (n2, p2) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert n1 == n2
        np.testing.assert_array_equal(p1.numpy(), p2.numpy())
    ids = batch()
    np.testing.assert_allclose(eager(ids).numpy(), lazy(ids).numpy(), rtol=1e-6)


def test_presets_parameter_counts_without_allocating():
    counts = {name: build(name, lazy=True).num_parameters() for name in ("gpt-100m", "gpt-1b", "llama-1b")}
    assert 0.9e8 <= counts["gpt-100m"] <= 1.1e8
    assert 0.9e9 <= counts["gpt-1b"] <= 1.2e9
    assert 0.9e9 <= counts["llama-1b"] <= 1.2e9
    assert set(PRESETS) >= {"gpt-tiny", "gpt-100m", "gpt-1b", "llama-tiny", "llama-1b"}


def test_rmsnorm_matches_numpy():
    paddle.seed(0)
    norm = RMSNorm(16, eps=1e-6)
    norm.weight.set_value(paddle.to_tensor(np.linspace(0.5, 1.5, 16, dtype="float32")))
    x = np.random.default_rng(0).standard_normal((3, 5, 16)).astype("float32")
    ref = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6) * norm.weight.numpy()
    np.testing.assert_allclose(norm(paddle.to_tensor(x)).numpy(), ref, rtol=1e-5, atol=1e-6)


def test_rotary_matches_pairwise_rotation():
    b, t, h, hd, theta = 2, 6, 3, 8, 10000.0
    x = np.random.default_rng(0).standard_normal((b, t, h, hd)).astype("float32")
    cos, sin = rotary_tables(16, hd, theta)
    out = apply_rotary(paddle.to_tensor(x), paddle.to_tensor(cos[:t]), paddle.to_tensor(sin[:t])).numpy()
    # reference: pair (x_i, x_{i + hd/2}) is rotated by angle pos * theta^(-2i/hd)
    half = hd // 2
    ang = np.arange(t)[:, None] * theta ** (-np.arange(half) * 2.0 / hd)[None, :]       # [t, half]
    c, s = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    ref = np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # a rotation keeps norms, and position 0 is the identity
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(out[:, 0], x[:, 0], rtol=1e-6)


def test_bad_configs_and_inputs():
    with pytest.raises(ValueError, match="divisible by heads"):
        GPTConfig(hidden=30, heads=4)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        LlamaConfig(hidden=32, heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="unknown model preset"):
        build("gpt-7t")
    with pytest.raises(ValueError, match="max_positions"):
        make("gpt")(batch(t=20))
    with pytest.raises(ValueError, match="max_positions"):
        make("llama")(batch(t=20))
