"""Tiny PaddleFormers causal LMs for tests and benchmarks: build, run on one process, run sharded.

    from autoparallel.testing import paddleformers_models as pf
    model = pf.build("llama")                       # vocab 128, hidden 64, 2 layers, 4 heads (2 kv heads)
    loss, grads = pf.reference("llama")             # one process: loss and {name: gradient}
    with ap.simulate(world_size=4):
        loss, grads = pf.sharded("llama", "tp")     # 2x2 ["data", "model"] mesh: "dp" or "tp" (the seed shard fn)

PaddleFormers' Qwen2/Qwen3/Qwen2-MoE modules import ``paddleformers.transformers.gpt_provider``, which
needs the GPU-only ``paddlefleet``; ``install_paddlefleet_stub()`` puts a stand-in module in
``sys.modules`` first (the paddle-native ``...Deprecated`` classes never use it).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import numpy as np

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 128, 64, 2, 4, 2, 128
_BASE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
             num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, fuse_rms_norm=False,
             max_position_embeddings=64)

# name -> (module under paddleformers.transformers, model class, config class, extra config)
MODELS = {
    "llama": ("llama", "LlamaForCausalLM", "LlamaConfig", {}),
    "qwen2": ("qwen2", "Qwen2ForCausalLMDeprecated", "Qwen2Config", {}),
    "qwen3": ("qwen3", "Qwen3ForCausalLMDeprecated", "Qwen3Config", {"head_dim": HIDDEN // HEADS}),
    "ernie4_5": ("ernie4_5", "Ernie4_5ForCausalLM", "Ernie4_5Config", {}),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", "Gemma3TextConfig", {"head_dim": HIDDEN // HEADS}),
    "phi3": ("phi3", "Phi3ForCausalLM", "Phi3Config", {}),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLMDeprecated", "Qwen2MoeConfig",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 64}),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM", "GptOssConfig",
                {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": HIDDEN // HEADS}),
}
MOE = ["qwen2_moe", "gpt_oss"]
DENSE = [n for n in MODELS if n not in MOE]

# the seed's shard function: column-parallel projections split their output dim, row-parallel their input dim
COL = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "up_gate_proj", "gate_up_proj")
ROW = ("o_proj", "down_proj")


def available() -> bool:
    """True when PaddleFormers is importable (the ``models`` extra)."""
    return importlib.util.find_spec("paddleformers") is not None


def install_paddlefleet_stub() -> None:
    """A stand-in for ``paddleformers.transformers.gpt_provider`` (it imports the GPU-only paddlefleet)."""
    name = "paddleformers.transformers.gpt_provider"
    if name in sys.modules:
        return
    stub = types.ModuleType(name)
    stub.GPTModelProvider = type("GPTModelProvider", (), {})
    sys.modules[name] = stub


def model_class(name: str):
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    install_paddlefleet_stub()
    sub, cls, cfg_cls, extra = MODELS[name]
    modeling = importlib.import_module(f"paddleformers.transformers.{sub}.modeling")
    config = importlib.import_module(f"paddleformers.transformers.{sub}.configuration")
    return getattr(modeling, cls), getattr(config, cfg_cls), extra


def config(name: str, **overrides):
    _, cfg_cls, extra = model_class(name)
    return cfg_cls(**{**_BASE, **extra, **overrides})


def build(name: str, seed: int = 0, **overrides):
    """A tiny model with parameters drawn from ``paddle.seed(seed)``."""
    import paddle

    cls, _, _ = model_class(name)
    cfg = config(name, **overrides)
    paddle.seed(seed)
    return cls(cfg)


def batch(seed: int = 0, b: int = 4, t: int = 8, vocab: int = VOCAB):
    """(input_ids, labels) as int64 numpy arrays."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (b, t)).astype("int64"), rng.integers(0, vocab, (b, t)).astype("int64")


def loss_of(out):
    """The loss of a causal LM's output (a tuple with the loss first, or a ModelOutput)."""
    if isinstance(out, (tuple, list)):
        return out[0]
    return out["loss"] if isinstance(out, dict) else out.loss


def reference(name: str, seed: int = 0, **overrides):
    """One process: (loss, {parameter name: gradient ndarray})."""
    import paddle

    model = build(name, seed, **overrides)
    ids, labels = batch(seed)
    loss = loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
    loss.backward()
    return float(loss), {n: _grad_np(p) for n, p in model.named_parameters()}


def seed_shard_fn(name, sublayer, mesh):
    """q/k/v/gate/up (and their fused forms) ``[Replicate(), Shard(1)]``, o/down ``[Replicate(), Shard(0)]``;
    everything else replicated (``shard_layer`` replicates what the function leaves alone)."""
    import autoparallel as ap

    leaf = name.rsplit(".", 1)[-1]
    dim = 1 if leaf in COL else 0 if leaf in ROW else None
    if dim is None or getattr(sublayer, "weight", None) is None:
        return
    sublayer.weight = ap.shard_tensor(sublayer.weight, mesh, [ap.Replicate(), ap.Shard(dim)])
    bias = getattr(sublayer, "bias", None)
    if bias is not None and dim == 1:
        sublayer.bias = ap.shard_tensor(bias, mesh, [ap.Replicate(), ap.Shard(0)])


def mesh_2x2():
    import autoparallel as ap

    return ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])


def sharded(name: str, mode: str, seed: int = 0, reduce_grads: bool = True, **overrides):
    """Inside ``ap.simulate(world_size=4)`` (or on 4 ranks): the model on a 2x2 ["data", "model"] mesh with
    the batch split over "data"; ``mode`` "dp" replicates every weight, "tp" applies ``seed_shard_fn``.
    Returns (loss, {parameter name: full gradient ndarray}); ``reduce_grads=False`` skips the data-parallel
    gradient reduction (a negative control: the gradients are then wrong)."""
    import paddle

    import autoparallel as ap

    if mode not in ("dp", "tp"):
        raise ValueError(f"mode must be 'dp' or 'tp', got {mode!r}")
    mesh = mesh_2x2()
    model = build(name, seed, **overrides)
    model = ap.shard_layer(model, mesh, seed_shard_fn if mode == "tp" else None)
    ids, labels = batch(seed)
    place = [ap.Shard(0), ap.Replicate()]
    ids = ap.shard_tensor(paddle.to_tensor(ids), mesh, place)
    labels = ap.shard_tensor(paddle.to_tensor(labels), mesh, place)
    loss = loss_of(model(input_ids=ids, labels=labels))
    loss.backward()
    if reduce_grads:
        ap.reduce_gradients(model.parameters())
    return float(loss), {n: _grad_np(p) for n, p in model.named_parameters()}


def _grad_np(p):
    import paddle

    spec = getattr(p, "_ap_spec", None)
    if spec is None:
        return p.grad.numpy() if p.grad is not None else np.zeros(p.shape, "float32")
    g = p.as_dist().grad
    if g is None:
        return np.zeros(spec.shape, "float32")
    return g.full().numpy() if isinstance(g.full(), paddle.Tensor) else np.asarray(g.full())


def compare(ref, got, rtol: float = 1e-4, atol: float = 1e-5) -> list:
    """Names whose gradients differ (plus "loss"), empty when everything matches."""
    (rl, rg), (gl, gg) = ref, got
    bad = [] if np.isclose(rl, gl, rtol=rtol, atol=atol) else ["loss"]
    for n, g in rg.items():
        if n not in gg or not np.allclose(gg[n], g, rtol=rtol, atol=atol):
            bad.append(n)
    return bad
