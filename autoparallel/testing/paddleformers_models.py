"""Tiny PaddleFormers causal LMs for tests and benchmarks: build, run on one process, run sharded.

    from autoparallel.testing import paddleformers_models as pf
    model = pf.build("llama")                       # vocab 128, hidden 64, 2 layers, 4 heads (2 kv heads)
    loss, grads = pf.reference("llama")             # one process: loss and {name: gradient}
    with ap.simulate(world_size=4):
        loss, grads = pf.sharded("llama", "tp")     # 2x2 ["data", "model"] mesh: "dp" or "tp" (the seed shard fn)

PaddleFormers' Qwen2/Qwen3/Qwen2-MoE/Qwen3-MoE/GLM-4-MoE modules import ``paddleformers.transformers.gpt_provider``,
which needs the GPU-only ``paddlefleet``, and its MoE token dispatcher imports ``paddlefleet_ops`` (DeepEP);
``install_paddlefleet_stub()`` puts stand-in modules in ``sys.modules`` first (the paddle-native
``...Deprecated`` classes and the naive MoE layers never use them).
"""
from __future__ import annotations

import copy
import importlib
import importlib.machinery
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
_HD = HIDDEN // HEADS
# MoE families added after the first eight: 4 routed experts, top-2, small expert FFNs
MODELS.update({
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLMDeprecated", "Qwen3MoeConfig",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": _HD}),
    # MLA attention (low-rank q and kv, decoupled rope dims), noaux_tc group-limited sigmoid gate with its
    # correction bias, a shared expert, one dense layer first, YaRN rope scaling (its mscale changes the softmax scale)
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
                    {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                     "v_head_dim": 16, "num_key_value_heads": HEADS, "topk_method": "noaux_tc", "n_group": 2,
                     "topk_group": 1, "scoring_func": "sigmoid", "norm_topk_prob": True, "first_k_dense_replace": 1,
                     "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}),
    "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLMDeprecated", "Glm4MoeConfig",
                 {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "first_k_dense_replace": 1, "head_dim": _HD, "using_flex_token": False}),
    # hybrid: a gated-delta-net (linear attention) layer then a gated full-attention layer, MoE with a shared expert
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
                   {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 32, "head_dim": _HD, "linear_key_head_dim": 8,
                    "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "layer_types": ["linear_attention", "full_attention"]}),
})
MOE = ["qwen2_moe", "gpt_oss", "qwen3_moe", "deepseek_v3", "glm4_moe", "qwen3_next"]
DENSE = [n for n in MODELS if n not in MOE]

# Config options that change the forward, per family (the sweep runs each next to the family's default config)
VARIANTS = {
    "llama": [{"attention_bias": True}, {"tie_word_embeddings": False},
              {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, {"_attn_implementation": "sdpa"},
              {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16}},
              {"recompute": True, "recompute_granularity": "full", "recompute_method": "uniform",
               "recompute_num_layers": 1}],
    "qwen2": [{"tie_word_embeddings": True},
              {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}],
    "qwen3": [{"attention_bias": True}, {"tie_word_embeddings": True},
              {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}],
    "ernie4_5": [{"use_bias": True}, {"tie_word_embeddings": False}],
    "gemma3": [{"attention_bias": True}, {"sliding_window": 4}],
    "phi3": [{"tie_word_embeddings": True}],
    "qwen2_moe": [{"qkv_bias": False}, {"norm_topk_prob": True}],
    "gpt_oss": [{"attention_bias": False}, {"layer_types": ["sliding_attention", "full_attention"],
                                            "sliding_window": 4}],
    "qwen3_moe": [{"attention_bias": True}, {"norm_topk_prob": True, "mlp_only_layers": [0]}],
    "deepseek_v3": [{"attention_bias": True}, {"q_lora_rank": None}, {"_attn_implementation": "sdpa"}],
    "glm4_moe": [{"use_qk_norm": True}, {"attention_bias": True}],
    "qwen3_next": [{"attention_bias": True}, {"partial_rotary_factor": 0.5}],
}

# Text causal-LM families of PaddleFormers 1.2 that do not run on a CPU, and why (the sweep's named skips)
SKIPPED = {
    "ernie4_5_moe": "its MoE layer (MOEAllGatherLayerV2) calls expand_modality_expert_id, a GPU-only kernel",
    "deepseek_v32": "built by a paddlefleet provider (GPU-only package)",
    "deepseek_v4": "built by a paddlefleet provider (GPU-only package)",
    "glm_moe_dsa": "built by a paddlefleet provider (GPU-only package)",
    "kimi_k2": "built by a paddlefleet provider (GPU-only package)",
    "minimax_m2": "built by a paddlefleet provider (GPU-only package)",
    "qwen3_5": "built by a paddlefleet provider (GPU-only package); a vision-language model",
    "qwen3_5_moe": "built by a paddlefleet provider (GPU-only package); a vision-language model",
}
# Options that do not run on a CPU: GPT-OSS's attention sinks under "sdpa" read a CUDA-only flag
SKIPPED_VARIANTS = {("gpt_oss", "_attn_implementation=sdpa"): "sink attention reads FLAGS_cudnn_deterministic "
                                                                "(CUDA-only)"}
# Families that are not text causal LMs (vision-language, OCR, speech): out of scope for the sweep
NOT_TEXT = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v_moe", "ernie4_5_moe_vl", "paddleocr_vl",
            "glm_ocr", "qwen3_omni_moe", "kimi_k25", "whisper")

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
    stub.GPTModelProvider = type("GPTModelProvider", (), {"transform_rules": {}})
    sys.modules[name] = stub
    if importlib.util.find_spec("paddlefleet_ops") is None:
        # imported at the top of paddleformers' MoE token dispatcher for DeepEP; the MoE layers built
        # here never dispatch through it. No location, so paddleformers' availability checks stay False.
        ops = types.ModuleType("paddlefleet_ops")
        ops.__spec__ = importlib.machinery.ModuleSpec("paddlefleet_ops", None)
        ops.is_deep_ep_available = lambda: False
        sys.modules["paddlefleet_ops"] = ops


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
    # a config may write into dicts it is given (rope_scaling): it gets copies, the tables stay as written
    return cfg_cls(**copy.deepcopy({**_BASE, **extra, **overrides}))


def build(name: str, seed: int = 0, fill_zeros: bool = False, **overrides):
    """A tiny model with parameters drawn from ``paddle.seed(seed)``. ``fill_zeros``: parameters the model
    initialises to zero (biases, some norm and gate weights) get small random values instead, so that a
    layout that adds a bias once per rank, or drops it, changes the loss."""
    import paddle

    cls, _, _ = model_class(name)
    cfg = config(name, **overrides)
    paddle.seed(seed)
    model = cls(cfg)
    if fill_zeros:
        _fill_zeros(model, seed)
    return model


def _fill_zeros(model, seed: int) -> None:
    rng = np.random.default_rng(seed + 1)
    for _, p in model.named_parameters():
        v = p.numpy()
        if v.size and not v.any():
            p.set_value((0.1 * rng.standard_normal(v.shape)).astype(v.dtype))


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


# ---- non-causal heads of the text families, and padded batches for them ------------------------------------
PAD = 0                                  # pad_token_id of the head configs; head_batch never draws it as a token
# head class -> (family in MODELS, kind of labels its loss takes)
HEAD_CLASSES = {"Qwen2ForSequenceClassification": ("qwen2", "class"), "Qwen3ForSequenceClassification": ("qwen3", "class"),
         "Qwen2ForTokenClassification": ("qwen2", "token"), "Qwen3ForTokenClassification": ("qwen3", "token"),
         "Qwen2SentenceEmbedding": ("qwen2", "pairs"), "Qwen3SentenceEmbedding": ("qwen3", "pairs"),
         "DeepseekV3ForSequenceClassification": ("deepseek_v3", "class")}
# head classes of PaddleFormers 1.2 that fail in one process already, and why
HEAD_CLASSES_BROKEN = {
    "Gemma3TextForSequenceClassification": "declares no forward: PretrainedModel.forward raises NotImplementedError",
    "DeepseekV3ForSequenceClassification": "__init__ calls self.post_init(), which PretrainedModel lacks "
                                           "(AttributeError); built here with a no-op post_init",
}
# speech / omni families that ship a processor and no model in PaddleFormers 1.2 (nothing to parallelize)
PROCESSOR_ONLY = {"whisper": "WhisperFeatureExtractor", "qwen3_omni_moe": "Qwen3OmniMoeProcessor"}


def build_head(cls_name: str, seed: int = 0, num_labels: int = 3, **overrides):
    """A tiny ``cls_name`` (a key of HEAD_CLASSES) with ``pad_token_id=PAD``, zero-initialised parameters filled."""
    import paddle

    family = HEAD_CLASSES[cls_name][0]
    model_class(family)                                         # installs the paddlefleet stub
    cls = getattr(importlib.import_module(f"paddleformers.transformers.{MODELS[family][0]}.modeling"), cls_name)
    if cls_name in HEAD_CLASSES_BROKEN and not hasattr(cls, "post_init"):
        cls = type(cls_name, (cls,), {"post_init": lambda self: None})
    cfg = config(family, pad_token_id=PAD, num_labels=num_labels, **overrides)
    paddle.seed(seed)
    model = cls(cfg)
    _fill_zeros(model, seed)
    return model


def backbone_class(family: str):
    """The plain ``*Model`` (decoder stack, no head) of a family."""
    return type(build(family).model)


def head_batch(kind: str, seed: int = 0, b: int = 4, t: int = 8, num_labels: int = 3, left: bool = False) -> dict:
    """Right-padded numpy inputs (lengths t, 5, 3, 6, ...; PAD after them, or before them with ``left``; mask 1
    on tokens) and labels of ``kind``: "class" [b] ids, "token" [b, t] ids (-100 on padding), "regression" [b]
    floats, "multi" [b, num_labels] 0/1 floats, "span" start/end positions, "pairs" query/passages dicts with
    last-token indices."""
    rng = np.random.default_rng(seed)
    lens = np.resize([t, 5, 3, 6], b).clip(1, t)
    mask = (np.arange(t)[None] < lens[:, None]).astype("int64")
    mask = mask[:, ::-1].copy() if left else mask
    ids = (rng.integers(1, VOCAB, (b, t)) * mask).astype("int64")
    out = {"input_ids": ids, "attention_mask": mask}
    if kind == "class":
        out["labels"] = rng.integers(0, num_labels, (b,)).astype("int64")
    elif kind == "token":
        out["labels"] = np.where(mask == 1, rng.integers(0, num_labels, (b, t)), -100).astype("int64")
    elif kind == "regression":
        out["labels"] = rng.standard_normal((b,)).astype("float32")
    elif kind == "multi":
        out["labels"] = (rng.random((b, num_labels)) > 0.5).astype("float32")
    elif kind == "span":
        first = t - lens if left else np.zeros(b, "int64")
        out["start_positions"] = (first + rng.integers(0, lens)).astype("int64")
        out["end_positions"] = (first + rng.integers(0, lens)).astype("int64")
    elif kind == "pairs":
        last = np.stack([np.arange(b), np.full(b, t - 1) if left else lens - 1], -1).astype("int64")
        passages = rng.integers(1, VOCAB, (b, t)).astype("int64")
        full = np.stack([np.arange(b), np.full(b, t - 1)], -1).astype("int64")
        return {"query": {"input_ids": ids, "attention_mask": mask, "embedding_indices": last},
                "passages": {"input_ids": passages, "attention_mask": np.ones_like(mask), "embedding_indices": full}}
    else:
        raise ValueError(f"kind must be class, token, regression, multi, span or pairs; got {kind!r}")
    return out


# ---- vision-language families: tiny configs, image + text batches, the seed shard function's vision names ----
# Token ids inside the tiny vocabulary: image pad, vision start / end, video pad (and GLM's video start / end)
VL_IMAGE, VL_START, VL_END, VL_VIDEO = 120, 121, 122, 123
_QWEN_TOKENS = dict(image_token_id=VL_IMAGE, video_token_id=VL_VIDEO, vision_start_token_id=VL_START,
                    vision_end_token_id=VL_END)
_GLM_TOKENS = dict(image_token_id=VL_IMAGE, video_token_id=VL_VIDEO, image_start_token_id=VL_START,
                   image_end_token_id=VL_END, video_start_token_id=124, video_end_token_id=125)
_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}   # head_dim 16
_VL_TEXT = dict(_BASE, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
_VL_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=HIDDEN, fuse_rms_norm=False)
_VL_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# name -> (module, model class, config class, text config extras (None: one flat config), vision extras, tokens)
VL_MODELS = {
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig", {},
                   dict(window_size=8, fullatt_block_indexes=[1]), _QWEN_TOKENS),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLForConditionalGenerationDeprecated", "Qwen3VLConfig",
                 dict(head_dim=16, rope_scaling=_MROPE), dict(num_position_embeddings=16, deepstack_visual_indexes=[0]),
                 _QWEN_TOKENS),
    "qwen3_vl_moe": ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGenerationDeprecated", "Qwen3VLMoeConfig",
                     dict(head_dim=16, rope_scaling=_MROPE, **_VL_MOE),
                     dict(num_position_embeddings=16, deepstack_visual_indexes=[0]), _QWEN_TOKENS),
    "glm4v_moe": ("glm4v_moe", "Glm4vMoeForConditionalGeneration", "Glm4vMoeConfig",
                  dict(head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       first_k_dense_replace=1, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                                 "partial_rotary_factor": 0.5}),
                  dict(image_size=8), _GLM_TOKENS),
    "glm_ocr": ("glm_ocr", "GlmOcrForConditionalGeneration", "GlmOcrConfig", dict(head_dim=16, mrope_section=(2, 3, 3)),
                dict(image_size=8), _GLM_TOKENS),
    "paddleocr_vl": ("paddleocr_vl", "PaddleOCRVLForConditionalGeneration", "PaddleOCRVLConfig", None,
                     dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          patch_size=2, image_size=8, spatial_merge_size=2, temporal_patch_size=2),
                     dict(image_token_id=VL_IMAGE, video_token_id=VL_VIDEO, vision_start_token_id=VL_START)),
}
VL_SKIPPED = {
    "ernie4_5_moe_vl": "its MoE layers call moe_gate_dispatch / expand_modality_expert_id, kernels registered for "
                       "GPU only",
    "qwen2_vl": "PaddleFormers 1.2 ships its processors only (no modeling)",
    "kimi_k25": "PaddleFormers 1.2 ships its processors only (no modeling)",
}
# the vision towers' projections: fused qkv and fc1 column-parallel, proj and fc2 row-parallel (2-D weights only:
# Qwen2.5-VL's conv patch embedding is also called "proj")
VL_COL = COL + ("qkv", "fc1", "linear_fc1")
VL_ROW = ROW + ("proj", "fc2", "linear_fc2")


def install_vl_stubs() -> None:
    """Qwen3-VL-MoE imports ``qwen3_vl.modeling_fleet`` (GPU-only paddlefleet; only its fleet classes use it), and
    PaddleOCR-VL imports ``paddleformers.triton_kernels``, which fails to import without triton: stand-ins say
    'unavailable', so the models take their own paddle paths."""
    install_paddlefleet_stub()
    name = "paddleformers.transformers.qwen3_vl.modeling_fleet"
    if name not in sys.modules:
        stub = types.ModuleType(name)
        stub.Qwen3VLModelDist = type("Qwen3VLModelDist", (), {})
        stub.Qwen3VLProvider = type("Qwen3VLProvider", (), {})
        sys.modules[name] = stub
    if importlib.util.find_spec("triton") is None and "paddleformers.triton_kernels" not in sys.modules:
        stub = types.ModuleType("paddleformers.triton_kernels")

        def unavailable(*args, **kwargs):
            raise NotImplementedError("triton kernels are not available on this machine")
        unavailable.is_available = lambda *args, **kwargs: False
        stub.apply_rotary_pos_emb_vision = stub.apply_rotary_emb = unavailable
        sys.modules["paddleformers.triton_kernels"] = stub


def vl_build(name: str, seed: int = 0):
    """A tiny vision-language model: text hidden 64, 2 layers; vision hidden 32, 2 blocks, 2x2 patches."""
    import paddle

    if name not in VL_MODELS:
        raise ValueError(f"unknown vision-language model {name!r}; known: {sorted(VL_MODELS)}")
    install_vl_stubs()
    sub, cls, cfg_cls, text, vision, tokens = VL_MODELS[name]
    modeling = importlib.import_module(f"paddleformers.transformers.{sub}.modeling")
    cfg_cls = getattr(importlib.import_module(f"paddleformers.transformers.{sub}.configuration"), cfg_cls)
    if text is None:            # one flat config (PaddleOCR-VL): the text fields at the top level
        flat = {k: v for k, v in _VL_TEXT.items() if k != "rope_scaling"}
        cfg = cfg_cls(**flat, head_dim=16, vision_config=copy.deepcopy(vision), **tokens,
                      rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    else:
        cfg = cfg_cls(text_config=copy.deepcopy({**_VL_TEXT, **text}), vision_config={**_VL_VISION, **vision},
                      fuse_rms_norm=False, **tokens)
    paddle.seed(seed)
    return getattr(modeling, cls)(cfg)


def vl_batch(name: str, seed: int = 0, b: int = 4, t: int = 12, grid=(1, 4, 4), grids=None) -> dict:
    """{input_ids, labels, pixel_values, image_grid_thw} as numpy arrays: one image of ``grid`` patches per
    sample (or ``grids``, one per sample: images of different sizes), its merged tokens (patches / 4) between
    vision start and end tokens. Pixels are flattened patches [patches, 3*2*2*2], or [patches, 3, 2, 2] images
    for PaddleOCR-VL's 2-D patch embedding."""
    rng = np.random.default_rng(seed)
    grids = [tuple(grid)] * b if grids is None else [tuple(g) for g in grids]
    ids = rng.integers(0, 100, (len(grids), t)).astype("int64")
    for i, g in enumerate(grids):
        n = int(np.prod(g)) // 4
        ids[i, 2], ids[i, 3:3 + n], ids[i, 3 + n] = VL_START, VL_IMAGE, VL_END
    patches = sum(int(np.prod(g)) for g in grids)
    shape = (patches, 3, 2, 2) if name == "paddleocr_vl" else (patches, 3 * 2 * 2 * 2)
    return {"input_ids": ids, "labels": rng.integers(0, 100, ids.shape).astype("int64"),
            "pixel_values": rng.standard_normal(shape).astype("float32"),
            "image_grid_thw": np.array(grids, "int64")}


def vl_shard_fn(name, sublayer, mesh):
    """``seed_shard_fn`` with the vision towers' names (``VL_COL`` / ``VL_ROW``), 2-D weights only."""
    import autoparallel as ap

    leaf = name.rsplit(".", 1)[-1]
    dim = 1 if leaf in VL_COL else 0 if leaf in VL_ROW else None
    weight = getattr(sublayer, "weight", None)
    if dim is None or weight is None or len(weight.shape) != 2:
        return
    sublayer.weight = ap.shard_tensor(weight, mesh, [ap.Replicate(), ap.Shard(dim)])
    bias = getattr(sublayer, "bias", None)
    if bias is not None and dim == 1:
        sublayer.bias = ap.shard_tensor(bias, mesh, [ap.Replicate(), ap.Shard(0)])
