"""LLaMA-style decoder: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases.

A plain ``paddle.nn.Layer`` unaware of parallelism. RMSNorm and rotary are written from basic ops
(``F.rms_norm`` and fused rotary have no CPU kernel). Layer names follow the usual checkpoints:
``embed_tokens``, ``layers.{i}.input_layernorm``, ``layers.{i}.self_attn.{q,k,v,o}_proj``,
``layers.{i}.post_attention_layernorm``, ``layers.{i}.mlp.{gate,up,down}_proj``, ``norm``, ``lm_head``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from .common import CausalLM, causal_attention, normal_attr


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: Optional[int] = None          # None: same as heads (plain multi-head attention)
    intermediate: Optional[int] = None      # None: 8/3 * hidden rounded up to a multiple of 32
    max_positions: int = 2048
    rope_theta: float = 10000.0
    eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.intermediate is None:
            self.intermediate = 32 * math.ceil(8 * self.hidden / 3 / 32)
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "intermediate", "max_positions"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.hidden % self.heads:
            raise ValueError(f"LlamaConfig: hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"LlamaConfig: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: rotary needs an even head_dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


PRESETS = {
    "llama-tiny": LlamaConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64,
                              max_positions=16),
    # TinyLlama-1.1B geometry
    "llama-1b": LlamaConfig(vocab_size=32000, hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632,
                            max_positions=2048),
}


class RMSNorm(nn.Layer):
    """y = x / sqrt(mean(x^2, last axis) + eps) * weight."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([hidden], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x):
        return x * paddle.rsqrt((x * x).mean(axis=-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(max_positions: int, head_dim: int, theta: float = 10000.0):
    """cos, sin tables of shape [max_positions, head_dim] (numpy float32, rotate-half layout)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)      # [P, hd/2]
    angles = np.concatenate([angles, angles], axis=-1)                            # [P, hd]
    return np.cos(angles).astype("float32"), np.sin(angles).astype("float32")


def apply_rotary(x, cos, sin):
    """x [b, t, h, hd]; cos, sin [t, hd]. Returns x * cos + rotate_half(x) * sin."""
    t, hd = cos.shape
    x1, x2 = paddle.split(x, 2, axis=-1)
    rotated = paddle.concat([-x2, x1], axis=-1)
    return x * cos.reshape([1, t, 1, hd]) + rotated * sin.reshape([1, t, 1, hd])


def repeat_kv(x, n: int):
    """[b, t, kv_heads, hd] -> [b, t, kv_heads * n, hd], each kv head repeated n times in place."""
    if n == 1:
        return x
    b, t, kvh, hd = x.shape
    return x.unsqueeze(3).expand([b, t, kvh, n, hd]).reshape([b, t, kvh * n, hd])


class Attention(nn.Layer):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.head_dim
        w = normal_attr(c.init_std)
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, weight_attr=w, bias_attr=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, weight_attr=w, bias_attr=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, weight_attr=w, bias_attr=False)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, weight_attr=w, bias_attr=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h, kvh, hd = self.heads, self.kv_heads, self.head_dim
        q = apply_rotary(self.q_proj(x).reshape([b, t, h, hd]), cos, sin)
        k = apply_rotary(self.k_proj(x).reshape([b, t, kvh, hd]), cos, sin)
        v = self.v_proj(x).reshape([b, t, kvh, hd])
        y = causal_attention(q, repeat_kv(k, h // kvh), repeat_kv(v, h // kvh))
        return self.o_proj(y.reshape([b, t, h * hd]))


class MLP(nn.Layer):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        w = normal_attr(c.init_std)
        self.gate_proj = nn.Linear(c.hidden, c.intermediate, weight_attr=w, bias_attr=False)
        self.up_proj = nn.Linear(c.hidden, c.intermediate, weight_attr=w, bias_attr=False)
        self.down_proj = nn.Linear(c.intermediate, c.hidden, weight_attr=w, bias_attr=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Layer):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden, c.eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(CausalLM):
    """ids [batch, seq] (int64) -> logits [batch, seq, vocab]. ``embed`` / ``layers`` / ``head`` are the
    pieces a pipeline stage runs (each layer takes ``(x, *model.rotary(seq))``)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden, weight_attr=normal_attr(c.init_std))
        self.layers = nn.LayerList([DecoderLayer(c) for _ in range(c.layers)])
        self.norm = RMSNorm(c.hidden, c.eps)
        self._add_lm_head(c)
        cos, sin = rotary_tables(c.max_positions, c.head_dim, c.rope_theta)
        self.register_buffer("rope_cos", paddle.to_tensor(cos), persistable=False)
        self.register_buffer("rope_sin", paddle.to_tensor(sin), persistable=False)

    def rotary(self, t: int):
        if t > self.config.max_positions:
            raise ValueError(f"sequence length {t} exceeds max_positions={self.config.max_positions}")
        return self.rope_cos[:t], self.rope_sin[:t]

    def embed(self, ids):
        return self.embed_tokens(ids)

    def head(self, x):
        return self.logits(self.norm(x), self.embed_tokens)

    def forward(self, ids):
        cos, sin = self.rotary(ids.shape[1])
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(x)
