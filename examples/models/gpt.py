"""GPT: learned positions, pre-LayerNorm blocks, causal self-attention, GELU MLP.

A plain ``paddle.nn.Layer`` that knows nothing about parallelism. Layer names are what tensor-parallel
plans match: ``wte``, ``wpe``, ``blocks.{i}.ln1``, ``blocks.{i}.attn.qkv``, ``blocks.{i}.attn.proj``,
``blocks.{i}.ln2``, ``blocks.{i}.mlp.fc1``, ``blocks.{i}.mlp.fc2``, ``ln_f``, ``lm_head`` (absent when the
embeddings are tied: the head is then ``x @ wte.weight^T``).

The fused ``qkv`` output is laid out head-major, ``[heads, 3, head_dim]``, so a column shard of ``qkv``
holds whole heads: reshaping to ``[b, t, heads, 3 * head_dim]`` and splitting the last axis needs no
communication under tensor parallelism.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import paddle
import paddle.nn.functional as F
from paddle import nn

from .common import CausalLM, causal_attention, normal_attr


@dataclass
class GPTConfig:
    vocab_size: int = 50304
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    max_positions: int = 1024
    ffn_mult: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = False
    init_std: float = 0.02
    eps: float = 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "hidden", "layers", "heads", "max_positions", "ffn_mult"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.hidden % self.heads:
            raise ValueError(f"GPTConfig: hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def seq_len(self) -> int:
        return self.max_positions

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


PRESETS = {
    "gpt-tiny": GPTConfig(vocab_size=64, hidden=32, layers=2, heads=4, max_positions=16),
    # the head reuses the input embedding (vocab-parallel under tensor parallelism: logits stay vocab-sharded)
    "gpt-tiny-tied": GPTConfig(vocab_size=64, hidden=32, layers=2, heads=4, max_positions=16,
                               tie_embeddings=True),
    # ~96M parameters (tied embeddings): GPT-2 small width, 8 blocks
    "gpt-100m": GPTConfig(vocab_size=50304, hidden=768, layers=8, heads=12, max_positions=1024,
                          tie_embeddings=True),
    # ~100M parameters with the examples' byte vocabulary (256): GPT-2 small width, 14 blocks
    "gpt-100m-byte": GPTConfig(vocab_size=256, hidden=768, layers=14, heads=12, max_positions=1024),
    # ~1.1B parameters (tied embeddings): 20 blocks of width 2048
    "gpt-1b": GPTConfig(vocab_size=50304, hidden=2048, layers=20, heads=16, max_positions=2048,
                        tie_embeddings=True),
}


def _dropout(x, p: float, training: bool):
    return F.dropout(x, p, training=training) if p > 0.0 else x


class Attention(nn.Layer):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads, self.dropout = c.heads, c.dropout
        self.qkv = nn.Linear(c.hidden, 3 * c.hidden, weight_attr=normal_attr(c.init_std))
        self.proj = nn.Linear(c.hidden, c.hidden, weight_attr=normal_attr(c.init_std / math.sqrt(2 * c.layers)))

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        qkv = self.qkv(x).reshape([b, t, h, 3 * (d // h)])
        q, k, v = paddle.split(qkv, 3, axis=-1)
        y = causal_attention(q, k, v).reshape([b, t, d])
        return _dropout(self.proj(y), self.dropout, self.training)


class MLP(nn.Layer):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.dropout = c.dropout
        self.fc1 = nn.Linear(c.hidden, c.ffn_mult * c.hidden, weight_attr=normal_attr(c.init_std))
        self.fc2 = nn.Linear(c.ffn_mult * c.hidden, c.hidden,
                             weight_attr=normal_attr(c.init_std / math.sqrt(2 * c.layers)))

    def forward(self, x):
        return _dropout(self.fc2(F.gelu(self.fc1(x))), self.dropout, self.training)


class Block(nn.Layer):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.hidden, epsilon=c.eps)
        self.attn = Attention(c)
        self.ln2 = nn.LayerNorm(c.hidden, epsilon=c.eps)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(CausalLM):
    """ids [batch, seq] (int64) -> logits [batch, seq, vocab]. ``embed`` / ``blocks`` / ``head`` are the
    three pieces a pipeline stage runs; ``forward`` is their composition."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        c = self.config = config
        self.wte = nn.Embedding(c.vocab_size, c.hidden, weight_attr=normal_attr(c.init_std))
        self.wpe = nn.Embedding(c.max_positions, c.hidden, weight_attr=normal_attr(c.init_std))
        self.blocks = nn.LayerList([Block(c) for _ in range(c.layers)])
        self.ln_f = nn.LayerNorm(c.hidden, epsilon=c.eps)
        self._add_lm_head(c)

    def embed(self, ids):
        b, t = ids.shape
        if t > self.config.max_positions:
            raise ValueError(f"sequence length {t} exceeds max_positions={self.config.max_positions}")
        x = self.wte(ids) + self.wpe(paddle.arange(t, dtype="int64"))
        return _dropout(x, self.config.dropout, self.training)

    def head(self, x):
        return self.logits(self.ln_f(x), self.wte)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
