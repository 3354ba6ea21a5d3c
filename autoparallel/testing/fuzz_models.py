"""Random small user models and random strategies, each drawn from a seed, for differential fuzzing: a
(model seed, strategy seed) pair trains 2-3 steps in one process and under autoparallel, and the losses and
every parameter must agree (see fuzz_runs.py and docs/fuzzing.md)."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

ACTS = ("gelu", "silu", "relu", "tanh")


TABLE = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "tanh": paddle.tanh}   # captured at import


def act(name, x):
    """The activation looked up at call time (``F.gelu(x)``, ``paddle.tanh(x)``)."""
    return paddle.tanh(x) if name == "tanh" else getattr(F, name)(x)


def _act_holder(layer, name):
    """``layer.act``: the name; with ``@attr`` also ``layer.act_fn``, the function TABLE captured at import."""
    if name.endswith("@attr"):
        layer.act_fn = TABLE[name[:-5]]
    layer.act = name


def apply_act(layer, x):
    return layer.act_fn(x) if layer.act.endswith("@attr") else act(layer.act, x)
BLOCKS = ("mlp", "attn_sdpa", "attn_matmul", "norm", "twice", "frozen", "dropout")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    seed: int
    stem: str              # "ids" (Embedding), "vec" (Linear), "conv1d", "conv2d" (+ BatchNorm)
    width: int             # divisible by 4
    blocks: tuple          # names from BLOCKS
    act: str
    norm: str              # "layer" or "rms"
    tied: bool             # ids only: logits = h @ embedding.T
    buffer: bool
    gpt_names: bool = False  # blocks.*.attn.qkv / blocks.*.mlp.fc1 / wte / lm_head: the default TP plan applies
    heads: int = 2
    classes: int = 8


def draw_model(seed: int) -> ModelSpec:
    r = random.Random(seed)
    stem = r.choice(["ids", "ids", "vec", "conv1d", "conv2d"])
    blocks = tuple(r.choice(BLOCKS) for _ in range(r.randint(1, 3)))
    return ModelSpec(seed, stem, 4 * r.randint(2, 6), blocks, r.choice(ACTS) + r.choice(["", "@attr"]), r.choice(["layer", "rms"]),
                     stem == "ids" and r.random() < 0.5, r.random() < 0.5, r.random() < 0.5, r.choice([1, 2, 4]))


class Mlp(nn.Layer):
    def __init__(self, d, act):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        _act_holder(self, act)

    def forward(self, x):
        return x + self.fc2(apply_act(self, self.fc1(x)))


class Attn(nn.Layer):
    def __init__(self, d, sdpa, heads):
        super().__init__()
        self.qkv, self.proj, self.sdpa, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), sdpa, heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = paddle.split(self.qkv(x), 3, axis=-1)
        shape = [b, t, self.heads, d // self.heads]
        q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
        if self.sdpa:                                   # [b, t, h, hd] layout
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            q, k, v = (a.transpose([0, 2, 1, 3]) for a in (q, k, v))
            s = paddle.matmul(q, k, transpose_y=True) / float(d // self.heads) ** 0.5
            o = paddle.matmul(F.softmax(s, axis=-1), v).transpose([0, 2, 1, 3])
        return x + self.proj(o.reshape([b, t, d]))


class RMSNorm(nn.Layer):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = self.create_parameter([d], default_initializer=nn.initializer.Constant(1.0))
        self.eps = eps

    def forward(self, x):
        return x * paddle.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight


class Twice(nn.Layer):
    """One Linear applied twice: its parameters are used twice in one forward."""

    def __init__(self, d, act):
        super().__init__()
        self.fc = nn.Linear(d, d)
        _act_holder(self, act)

    def forward(self, x):
        return x + self.fc(apply_act(self, self.fc(x)))


class Frozen(nn.Layer):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        for p in self.fc.parameters():
            p.stop_gradient = True

    def forward(self, x):
        return x + self.fc(x)


class Named(nn.Layer):
    """GPT-style naming: the block's layer under ``attn`` or ``mlp``."""

    def __init__(self, key, inner):
        super().__init__()
        setattr(self, key, inner)
        self.key = key

    def forward(self, x):
        return getattr(self, self.key)(x)


def _named_block(name, spec):
    inner = _block(name, spec)
    if spec.gpt_names and (name == "mlp" or name.startswith("attn")):
        return Named("mlp" if name == "mlp" else "attn", inner)
    return inner


def _block(name, spec):
    d = spec.width
    if name == "mlp":
        return Mlp(d, spec.act)
    if name.startswith("attn"):
        return Attn(d, name == "attn_sdpa", spec.heads)
    if name == "norm":
        return nn.LayerNorm(d) if spec.norm == "layer" else RMSNorm(d)
    if name == "twice":
        return Twice(d, spec.act)
    if name == "frozen":
        return Frozen(d)
    return nn.Dropout(p=0.0)


class FuzzModel(nn.Layer):
    """stem -> blocks -> norm -> head; input ids [b, t], vectors [b, t, f], [b, c, t] or images [b, c, h, w];
    output logits [b, t, classes] (or [b, t, vocab] with a tied head)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        d, self.spec = spec.width, spec
        self.e_name = "wte" if spec.gpt_names and spec.stem == "ids" else "embed"
        self.h_name = "lm_head" if spec.gpt_names else "head"
        if spec.stem == "ids":
            embed = nn.Embedding(spec.classes * 2, d)
        elif spec.stem == "vec":
            embed = nn.Linear(6, d)
        elif spec.stem == "conv1d":
            embed = nn.Conv1D(3, d, 3, padding=1)
        else:
            embed, self.bn = nn.Conv2D(3, d, 3, padding=1), nn.BatchNorm2D(d)
        setattr(self, self.e_name, embed)
        if spec.buffer:
            self.register_buffer("scale", paddle.linspace(0.5, 1.5, d))
        self.blocks = nn.LayerList([_named_block(n, spec) for n in spec.blocks])
        self.norm = nn.LayerNorm(d) if spec.norm == "layer" else RMSNorm(d)
        if not spec.tied:
            setattr(self, self.h_name, nn.Linear(d, spec.classes))

    def forward(self, x):
        h = self._stem(x)
        if self.spec.buffer:
            h = h * self.scale
        for blk in self.blocks:
            h = blk(h)
        h = self.norm(h)
        if self.spec.tied:
            return paddle.matmul(h, getattr(self, self.e_name).weight, transpose_y=True)
        return getattr(self, self.h_name)(h)

    def _stem(self, x):
        embed = getattr(self, self.e_name)
        if self.spec.stem in ("ids", "vec"):
            return embed(x)
        if self.spec.stem == "conv1d":
            return embed(x).transpose([0, 2, 1])
        h = F.relu(self.bn(embed(x)))                    # [b, d, 2, 4] -> [b, 8, d]
        return h.flatten(2).transpose([0, 2, 1])


def build_model(spec: ModelSpec) -> FuzzModel:
    paddle.seed(spec.seed)
    return FuzzModel(spec)


def draw_batch(spec: ModelSpec, seed: int, b: int = 8, t: int = 8):
    """Numpy (inputs, labels [b, t]) for ``spec``."""
    rng = np.random.default_rng(seed)
    n = spec.classes * 2 if spec.tied else spec.classes
    labels = rng.integers(0, n, (b, t)).astype("int64")
    if spec.stem == "ids":
        return rng.integers(0, spec.classes * 2, (b, t)).astype("int64"), labels
    shape = {"vec": (b, t, 6), "conv1d": (b, 3, t), "conv2d": (b, 3, 2, t // 2)}[spec.stem]
    return rng.standard_normal(shape).astype("float32"), labels


# ---- strategies --------------------------------------------------------------------------------------------
KINDS = ("dp", "tp", "dp_tp", "zero1", "zero2", "zero3", "recompute", "full", "shard_layer")


@dataclasses.dataclass(frozen=True)
class StrategySpec:
    kind: str
    world: int             # 2 or 4
    accumulate: int        # 1 or 2
    optimizer: str         # "adamw" or "sgd"
    clip: float | None
    shard_fn: tuple = ()   # shard_layer: ((linear name, "S(0)" | "S(1)" | "R"), ...)
    extra: tuple = ()      # dp / tp / dp_tp composed with "zero1" | "zero2" | "zero3" and/or "recompute"
    data: str = "S(0)"     # shard_layer: the inputs' placement, "S(0)" or "R"


def draw_strategy(seed: int, linear_names=()) -> StrategySpec:
    r = random.Random(10_000 + seed)
    kind = r.choice(KINDS)
    world = r.choice([2, 4])
    fn = tuple((n, r.choice(["S(0)", "S(1)", "R"])) for n in linear_names) if kind == "shard_layer" else ()
    r2 = random.Random(20_000 + seed)          # drawn apart, so the fields above stay what a seed gave
    extra = ()
    if kind in ("dp", "tp", "dp_tp"):
        extra = tuple(x for x in (r2.choice(["", "zero1", "zero2", "zero3"]), r2.choice(["", "recompute"])) if x)
    data = r2.choice(["S(0)", "R"]) if kind == "shard_layer" else "S(0)"
    return StrategySpec(kind, world, r.choice([1, 2]), r.choice(["adamw", "sgd"]), r.choice([None, 1.0]), fn,
                        extra, data)


def linear_names(model) -> tuple:
    return tuple(n for n, l in model.named_sublayers() if isinstance(l, nn.Linear))


def make_optimizer(sspec: StrategySpec, params):
    clip = paddle.nn.ClipGradByGlobalNorm(sspec.clip) if sspec.clip else None
    if sspec.optimizer == "sgd":
        return paddle.optimizer.SGD(0.1, parameters=params, grad_clip=clip)
    return paddle.optimizer.AdamW(1e-2, parameters=params, epsilon=1e-4, grad_clip=clip)
