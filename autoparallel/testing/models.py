"""Reference runs of the example models: single process vs distributed, for tests and benchmarks."""
from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

GPT_PLAN = {"blocks.*.attn.qkv": "col", "blocks.*.attn.proj": "row", "blocks.*.mlp.fc1": "col",
            "blocks.*.mlp.fc2": "row", "wte": "vocab", "lm_head": "col"}
LLAMA_PLAN = {"layers.*.self_attn.q_proj": "col", "layers.*.self_attn.k_proj": "col",
              "layers.*.self_attn.v_proj": "col", "layers.*.self_attn.o_proj": "row",
              "layers.*.mlp.gate_proj": "col", "layers.*.mlp.up_proj": "col", "layers.*.mlp.down_proj": "row",
              "embed_tokens": "vocab", "lm_head": "col"}


def tp_plan(kind: str) -> dict:
    from autoparallel.parallel.tensor_parallel import ColWiseParallel, RowWiseParallel, VocabParallelEmbedding

    styles = {"col": ColWiseParallel(), "row": RowWiseParallel(), "vocab": VocabParallelEmbedding()}
    return {k: styles[v] for k, v in (GPT_PLAN if kind == "gpt" else LLAMA_PLAN).items()}


def build(kind: str, seed: int = 0):
    from examples.models import GPT, GPTConfig, Llama, LlamaConfig

    paddle.seed(seed)
    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=64, hidden=32, layers=2, heads=4, max_positions=16))
    return Llama(LlamaConfig(vocab_size=64, hidden=32, layers=2, heads=8, kv_heads=4, intermediate=48,
                             max_positions=16))


def batch(seed: int = 0, b: int = 4, t: int = 8, vocab: int = 64):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (b, t)), rng.integers(0, vocab, (b, t))


def reference(kind: str, seed: int = 0):
    """Single-process loss and gradients {name: ndarray}."""
    model = build(kind, seed)
    ids, labels = batch(seed)
    loss = F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(labels)).mean()
    loss.backward()
    return float(loss), {n: p.grad.numpy() for n, p in model.named_parameters()}


def adamw(params, **kwargs):
    """The tests' optimizer: AdamW, lr 1e-2; epsilon 1e-4 as the attention key bias has a zero gradient (Adam
    would amplify round-off)."""
    return paddle.optimizer.AdamW(1e-2, parameters=params, epsilon=1e-4, **kwargs)


def fit(model, optimizer, pairs, **backward_kwargs) -> list:
    """One optimizer step per (ids, labels) numpy pair of ``pairs`` (mean cross-entropy); the losses."""
    losses = []
    for ids, lab in pairs:
        loss = F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()
        loss.backward(**backward_kwargs)
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    return losses


def train_steps(model, optimizer, steps: int, **backward_kwargs) -> list:
    """``steps`` optimizer steps on ``batch(0)``, ``batch(1)``, ...; the losses."""
    return fit(model, optimizer, (batch(i) for i in range(steps)), **backward_kwargs)


def parameters_np(model) -> dict:
    """{name: ndarray} of every parameter of a single-process model."""
    return {n: p.numpy() for n, p in model.named_parameters()}


def trained_reference(kind: str = "gpt", steps: int = 3, make_opt=adamw):
    """Single-process losses of ``steps`` training steps and the final parameters {name: ndarray}."""
    model = build(kind)
    return train_steps(model, make_opt(model.parameters()), steps), parameters_np(model)
