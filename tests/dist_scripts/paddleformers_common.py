"""Tiny PaddleFormers causal LMs and the three ways the tests run them (plain DP, the seed's shard
function, ``ap.parallelize``), with the one-process reference they are compared to."""
from __future__ import annotations

import importlib
import sys
import types

import numpy as np

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, fuse_rms_norm=False, max_position_embeddings=64)
DENSE = {   # name: (module, config class, model class, config overrides)
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLMDeprecated", {}),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLMDeprecated", {}),
    "ernie4_5": ("ernie4_5", "Ernie4_5Config", "Ernie4_5ForCausalLM", {}),
    "gemma3": ("gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM", {}),
    "phi3": ("phi3", "Phi3Config", "Phi3ForCausalLM", {}),
}
MOE = {"qwen2_moe": ("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLMDeprecated",
                     dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=64))}
MODELS = {**DENSE, **MOE}


def available() -> bool:
    try:
        import paddleformers  # noqa: F401
    except ImportError:
        return False
    return True


def _stub_gpt_provider():
    """Qwen2/3's modules import ``gpt_provider``, which imports the GPU-only paddlefleet; the paddle-native
    (``...Deprecated``) classes used here never touch it."""
    name = "paddleformers.transformers.gpt_provider"
    if name not in sys.modules:
        try:
            importlib.import_module(name)
        except Exception:
            stub = types.ModuleType(name)
            stub.GPTModelProvider = type("GPTModelProvider", (), {})
            sys.modules[name] = stub


def build(name: str, seed: int = 0, **overrides):
    import paddle

    _stub_gpt_provider()
    mod, cfg_cls, model_cls, extra = MODELS[name]
    module = importlib.import_module(f"paddleformers.transformers.{mod}")
    cfg = getattr(module, cfg_cls)(**{**CONFIG, **extra, **overrides})
    paddle.seed(seed)
    return getattr(module, model_cls)(cfg)


def batch(seed: int = 0, b: int = 4, t: int = 8, vocab: int = 128):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (b, t)).astype("int64"), rng.integers(0, vocab, (b, t)).astype("int64")


def loss_of(out):
    return out[0] if isinstance(out, (tuple, list)) else out.loss


def reference(name: str, seed: int = 0):
    """One process: loss and {parameter name: gradient}."""
    import paddle

    model = build(name, seed)
    ids, labels = batch(seed)
    loss = loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
    loss.backward()
    return float(loss), {n: p.grad.numpy() for n, p in model.named_parameters()}


def seed_shard_fn(name, layer, mesh):
    """The seed article's shard function: q/k/v/gate/up (and fused) weights [R, S(1)], o/down [R, S(0)]."""
    import autoparallel as ap

    last = name.rsplit(".", 1)[-1]
    if "experts." in name + ".":
        return
    if last in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "up_gate_proj", "gate_up_proj"):
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Replicate(), ap.Shard(1)])
    elif last in ("o_proj", "down_proj"):
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Replicate(), ap.Shard(0)])
