"""ModelSpec: the dimensions of a decoder-only transformer, as the cost model sees it.

A model is ``layers`` identical blocks (attention + MLP) between an input embedding and an output
head. Parameter counts and FLOPs follow Narayanan et al. (SC'21) and Korthikanti et al. (MLSys'23),
generalised to grouped-query attention (``kv_heads``), any FFN width and SwiGLU MLPs:

    matmul parameters per layer  P_mm = h·h (q) + 2·h·kv_dim (k, v) + h·h (out) + n_mlp·h·f
                                 (n_mlp = 3 for SwiGLU, 2 otherwise; kv_dim = kv_heads·h/heads)
    forward FLOPs per token      l·(2·P_mm + 4·s·h) + 2·h·V       (attention scores counted over all s keys)

For GPT (f = 4h, kv_heads = heads) 2·P_mm = 24h², which gives Megatron's
72·B·s·l·h²·(1 + s/6h + V/12lh) model FLOPs per iteration. In general the attention's matmuls are counted from
the head widths (``attention_params``) and its core is 2·s·a·(d_qk + d_v) per token, which covers multi-head
latent attention (DeepSeek-V2/V3: low-rank query and key/value projections, ``kv_lora_rank`` > 0); multi-token
prediction modules (``mtp_depth``, DeepSeek-V3 §2.2) add a block, a 2h x h projection and an output-head pass each.

Presets: ``gpt3-*`` (Brown et al. 2020, vocabulary padded to 51200 as Megatron does), ``megatron-*``
(the rows of Narayanan et al. Table 1), ``llama2-*`` and ``llama3-*`` (published configurations).
``ModelSpec.from_trace(model, seq_len, batch)`` reads one off a real paddle model (planner/from_trace.py).

``OpProfile`` counts what the eager runtime pays per-op overheads on (dispatched forward ops, parameter
tensors, parameter-owning layers, tensor-parallel linears); without a trace a template of the example
models' structure is used (``op_profile``).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace

from autoparallel.config.fields import integral
from autoparallel.planner.latent_attention import LatentAttentionShapes


@dataclass(frozen=True)
class OpProfile:
    """Per-micro-batch counts of the eager runtime (from an op trace, or ``template_profile``)."""
    layer_ops: int                # dispatched forward ops of one block
    outside_ops: int              # dispatched forward ops outside the blocks (embeddings, head, loss)
    core_ops: int                 # ops of one block's attention core (run again by selective recompute)
    layer_tensors: int            # parameter tensors of one block
    outside_tensors: int          # parameter tensors outside the blocks
    layer_param_layers: int       # sublayers of one block owning parameters (ZeRO-3 gathers each one)
    outside_param_layers: int     # such sublayers outside the blocks
    row_parallel: int             # row-parallel linears of one block (a forward all_reduce each under TP)
    col_parallel: int             # column-parallel linears of one block (a backward all_reduce each under TP)


def template_profile(model) -> OpProfile:
    """Counts of the example models' structure (examples/models): GPT blocks with a fused qkv projection
    (21 ops, 12 tensors), LLaMA blocks with separate q/k/v, rotary and RMSNorm from basic ops and a SwiGLU
    MLP (54 ops, 9 tensors); embeddings, final norm (1 op, or 6 for an RMSNorm), LM head and a cross-entropy
    loss outside; a 9-op attention core."""
    if model.swiglu:
        layer_ops, layer_tensors, owners, col = 54, 2 + 7, 2 + 7, 5
    else:
        layer_ops, layer_tensors, owners, col = 21, (4 if model.layernorm else 2) + (8 if model.bias else 4), 6, 2
    outside_ops = 3 + (2 if model.learned_positions else 0) + (1 if model.layernorm else 6)
    head = 0 if model.tied_embeddings else 1
    norm_tensors = 2 if model.layernorm else 1
    outside_tensors = 1 + int(model.learned_positions) + norm_tensors + head
    outside_owners = 1 + int(model.learned_positions) + 1 + head
    return OpProfile(layer_ops, outside_ops, 9, layer_tensors, outside_tensors, owners, outside_owners, 2, col)


@dataclass(frozen=True)
class ModelSpec(LatentAttentionShapes):
    name: str                     # preset name or "custom"
    hidden: int                   # h: model width
    layers: int                   # l: number of transformer blocks
    heads: int                    # a: attention (query) heads
    vocab: int                    # V: vocabulary size (as padded for training)
    ffn: int = 0                  # f: MLP inner width; 0 means 4·hidden
    kv_heads: int = 0             # key/value heads (GQA); 0 means heads (multi-head attention)
    seq_len: int = 2048           # default training sequence length (and learned position table size)
    swiglu: bool = False          # gated MLP with three matrices (LLaMA) instead of two (GPT)
    bias: bool = True             # linear layers carry biases (GPT) or not (LLaMA)
    layernorm: bool = True        # LayerNorm (weight + bias) or RMSNorm (weight only)
    tied_embeddings: bool = True  # output head shares the input embedding matrix (GPT)
    learned_positions: bool = True  # a learned position table of seq_len x hidden (GPT) or rotary (LLaMA)
    dropout: bool = True          # dropout layers are present, so their masks are kept for backward (GPT)
    positions: int = 0            # rows of the learned position table; 0 means seq_len
    parallel_block: bool = False  # attention and MLP side by side on the block input, summed before one forward TP
                                  # all-reduce (GPT-J, GPT-NeoX `gpt_j_residual`); False: one after the other
    ops: OpProfile = None         # eager-runtime op counts (from a trace); None: template_profile
    traced: object = None         # from_trace's per-layer figures (from_trace.TraceFacts), or None
    # -- mixture of experts (0 experts: a dense model). MoE blocks replace the MLP by ``experts`` routed
    #    experts of width ``expert_ffn`` (each token visits ``top_k``) plus ``shared_experts`` always-on ones;
    #    the first ``dense_layers`` blocks keep the dense MLP of width ``ffn``.
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    route_nodes: int = 0          # node-limited routing: a token reaches at most this many nodes (0: no limit)
    # -- read off a real model (from_trace / from_config): parameters per block the closed form does not
    #    describe (qk norms, gates, biases of some matrices only; negative when the form
    #    counts more), priced as replicated; and a text saying which figures were traced, read from the
    #    model's config or estimated
    extra_layer_params: float = 0.0
    attn_dim: int = 0             # width of the query heads, heads·head_dim; 0 means hidden (Qwen3 and ERNIE 4.5
                                  # set head_dim so that heads·head_dim != hidden)
    # -- head widths apart from head_dim, and multi-head latent attention (MLA: DeepSeek-AI 2024, arXiv:2412.19437
    #    §2.1.1; the config.json names q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim).
    #    MLA projects the hidden state down to low-rank latents (replicated under TP, as the runtime's MLA plan keeps
    #    q_a_proj / kv_a_proj_with_mqa), normalises them, and projects them up per head (split by TP with the heads)
    qk_head_dim: int = 0          # width of one query/key head (MLA: qk_nope_head_dim + qk_rope_head_dim); 0: head_dim
    v_head_dim: int = 0           # width of one value head, also one head's share of the output projection; 0: head_dim
    q_lora_rank: int = 0          # MLA query rank r_q: q_a h x r_q, a norm, q_b r_q x heads·qk_head_dim; 0: one
                                  # full-rank h x heads·qk_head_dim query projection
    kv_lora_rank: int = 0         # MLA key/value latent r_kv: kv_a h x (r_kv + qk_rope_head_dim), a norm, kv_b
                                  # r_kv x heads·(qk_head_dim - qk_rope_head_dim + v_head_dim); 0: no MLA
    qk_rope_head_dim: int = 0     # MLA: rotary part of each query/key head; its key part is one vector per token
                                  # shared by all heads (the last qk_rope_head_dim columns of kv_a)
    # -- multi-token prediction (DeepSeek-AI 2024 §2.2): ``mtp_depth`` modules after the last block, each one more
    #    block (an MoE block when the model has experts), a 2h x h projection of [norm(h_prev); norm(embedding)] and
    #    a second output-head pass with its cross-entropy; embedding and output head shared with the main model
    mtp_depth: int = 0
    source: str = ""
    # -- share of the parameters that train (a LoRA run: the adapters'); gradient buffers, their sync, the
    #    optimizer states and master copies count only these, the weights (and ZeRO-3's gathers) all of them
    trainable_fraction: float = 1.0

    def __post_init__(self):
        for field_name in ("hidden", "layers", "heads", "vocab", "seq_len"):
            value = getattr(self, field_name)
            number = integral(value)             # numpy ints as ints; bools and floats refused
            if number is None or number <= 0:
                raise ValueError(f"model {self.name!r}: {field_name} must be a positive integer, got {value!r}")
            object.__setattr__(self, field_name, number)
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn < 0 or self.kv_heads < 0:
            raise ValueError(f"model {self.name!r}: ffn and kv_heads must be positive, got ffn={self.ffn}, "
                             f"kv_heads={self.kv_heads}")
        if self.attn_dim < 0 or (self.attn_dim or self.hidden) % self.heads:
            raise ValueError(f"model {self.name!r}: attn_dim or hidden ({self.attn_dim or self.hidden}) must be "
                             f"divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads ({self.heads}) must be divisible by kv_heads "
                             f"({self.kv_heads})")
        self._check_moe()
        self._check_mla()
        f = self.trainable_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise ValueError(f"model {self.name!r}: trainable_fraction must be a number in [0, 1] (the share of the "
                             f"parameters that train), got {f!r}")

    def _check_moe(self):
        for name in ("experts", "top_k", "expert_ffn", "shared_experts", "dense_layers", "route_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"model {self.name!r}: {name} must be a non-negative integer, got {value!r}")
        if self.experts == 0:
            if self.top_k or self.expert_ffn or self.shared_experts or self.dense_layers or self.route_nodes:
                raise ValueError(f"model {self.name!r}: top_k, expert_ffn, shared_experts and dense_layers describe "
                                 f"a mixture of experts and need experts > 0, got experts=0")
            return
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"model {self.name!r}: top_k must be between 1 and the number of experts "
                             f"({self.experts}), got top_k={self.top_k}")
        if self.expert_ffn <= 0:
            raise ValueError(f"model {self.name!r}: a mixture of experts needs expert_ffn > 0, got {self.expert_ffn}")
        if self.dense_layers >= self.layers:
            raise ValueError(f"model {self.name!r}: dense_layers ({self.dense_layers}) must leave at least one MoE "
                             f"block of the {self.layers}")

    # ---- mixture of experts ------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_fraction(self) -> float:
        """Share of the blocks that are MoE blocks (per-block figures below are averages over all blocks)."""
        return (self.layers - self.dense_layers) / self.layers if self.is_moe else 0.0

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (an MLP of width expert_ffn)."""
        return self.mlp_matrices * self.hidden * self.expert_ffn

    @property
    def layer_expert_params(self) -> float:
        """Routed-expert parameters per block, averaged over blocks: split by expert parallelism and TP."""
        return self.moe_fraction * self.experts * self.expert_params

    @property
    def active_ffn(self) -> float:
        """MLP width one token goes through, averaged over blocks (dense: ffn; MoE: (top_k + shared)·expert_ffn)."""
        if not self.is_moe:
            return float(self.ffn)
        f = self.moe_fraction
        return (1 - f) * self.ffn + f * (self.top_k + self.shared_experts) * self.expert_ffn

    def moe_tokens_fraction(self) -> float:
        """Token copies sent to experts per token and MoE block (top_k), averaged over blocks."""
        return self.moe_fraction * self.top_k

    # ---- dimensions -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return (self.attn_dim or self.hidden) // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: kv_heads·head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.swiglu else 2

    # ---- parameters -------------------------------------------------------------------------
    @property
    def layer_matmul_params(self):
        """P_mm: parameters of the block's matmuls (q, k, v, out, MLP), the ones tensor parallelism splits.
        For MoE: attention, the dense MLP of the dense blocks, shared experts and the router, averaged over
        blocks; the routed experts are ``layer_expert_params``."""
        h = self.hidden
        attention = self.attention_params[0]
        if not self.is_moe:
            return attention + self.mlp_matrices * h * self.ffn
        f = self.moe_fraction
        return (attention + (1 - f) * self.mlp_matrices * h * self.ffn
                + f * (self.shared_experts * self.expert_params + h * self.experts))

    @property
    def layer_other_params(self) -> int:
        """Biases and norm weights of one block, and MLA's low-rank down-projections and latent norms
        (replicated under tensor parallelism)."""
        h = self.hidden
        norms = 2 * (2 * h if self.layernorm else h) + self.latent_norm_params
        biases = (h + 2 * self.kv_dim + h + (self.mlp_matrices - 1) * self.ffn + h) if self.bias else 0
        return norms + biases + self.attention_params[1] + self.extra_layer_params

    @property
    def layer_params(self) -> int:
        return self.layer_matmul_params + self.layer_other_params

    @property
    def position_params(self) -> int:
        """The learned position table (positions·h, positions defaulting to seq_len), else 0."""
        return (self.positions or self.seq_len) * self.hidden if self.learned_positions else 0

    @property
    def embedding_params(self) -> int:
        """Input token embedding (and the learned position table, if any)."""
        return self.vocab * self.hidden + self.position_params

    @property
    def layer_column_bias_params(self) -> int:
        """Biases of the column-parallel linears (q, k, v and the MLP's input matrices): split by TP."""
        return (self.hidden + 2 * self.kv_dim + (self.mlp_matrices - 1) * self.ffn) if self.bias else 0

    @property
    def head_params(self) -> int:
        """Output projection to the vocabulary (0 when tied to the input embedding) plus the final norm."""
        norm = 2 * self.hidden if self.layernorm else self.hidden
        return (0 if self.tied_embeddings else self.vocab * self.hidden) + norm

    @property
    def params(self) -> int:
        """Total parameter count (the multi-token-prediction modules included)."""
        return int(round(self.layers * (self.layer_params + self.layer_expert_params) + self.embedding_params
                         + self.head_params + self.mtp_depth * self.mtp_module_params))

    # ---- FLOPs -------------------------------------------------------------------------------
    def layer_forward_flops_per_token(self, seq_len: int) -> float:
        """2·P_mm + 4·s·h: the block's matmuls plus attention scores (QK^T) and their use (AV); MoE blocks add
        the top_k routed experts a token visits; MLA adds its replicated down-projections."""
        routed = self.moe_fraction * self.top_k * self.expert_params
        return (2.0 * (self.layer_matmul_params + routed) + self.layer_replicated_flops_per_token()
                + self.attention_core_flops_per_token(seq_len))

    def router_flops_per_token(self) -> float:
        """2·h·E per MoE block, averaged over blocks: the gate's matmul (part of 2·P_mm)."""
        return 2.0 * self.moe_fraction * self.hidden * self.experts

    def logits_forward_flops_per_token(self) -> float:
        """2·h·V: the output projection."""
        return 2.0 * self.hidden * self.vocab

    def model_flops_per_token(self, seq_len: int = None) -> float:
        """Model FLOPs per token, forward + backward (3x forward), without recomputation (MFU's numerator)."""
        s = self.seq_len if seq_len is None else seq_len
        return 3.0 * (self.layers * self.layer_forward_flops_per_token(s) + self.logits_forward_flops_per_token()
                      + self.mtp_forward_flops_per_token(s))

    def hardware_flops_per_token(self, seq_len: int = None, recompute: str = "none") -> float:
        """FLOPs per token counting recomputation, as Megatron's papers count them.

        full: every block's forward runs twice (GPT: 96·B·s·l·h²·(1 + s/6h + V/16lh) per iteration);
        selective: the attention core's forward runs twice; none: equal to model FLOPs.
        """
        s = self.seq_len if seq_len is None else seq_len
        blocks = self.layers + self.mtp_depth                  # the multi-token-prediction blocks run it too
        mtp = self.mtp_block() if self.mtp_depth else self
        extra = {"none": 0.0, "selective": blocks * self.attention_core_flops_per_token(s),
                 "full": self.layers * self.layer_forward_flops_per_token(s)
                 + self.mtp_depth * mtp.layer_forward_flops_per_token(s)}
        if recompute not in extra:
            raise ValueError(f"recompute must be one of {sorted(extra)}, got {recompute!r}")
        return self.model_flops_per_token(s) + extra[recompute]

    # ---- construction ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def with_seq_len(self, seq_len: int) -> "ModelSpec":
        return replace(self, seq_len=int(seq_len))

    def op_profile(self) -> OpProfile:
        """The traced eager-runtime counts, or the example models' template."""
        return self.ops if self.ops is not None else template_profile(self)

    def short_dims(self) -> str:
        return (f"hidden={self.hidden}, layers={self.layers}, heads={self.heads}, kv_heads={self.kv_heads}, "
                f"ffn={self.ffn}, vocab={self.vocab}, swiglu={self.swiglu}")

    @classmethod
    def from_trace(cls, model, seq_len: int, batch: int, name: str = "traced") -> "ModelSpec":
        """A ModelSpec of a real paddle model (a decoder-only transformer: embedding, a LayerList of blocks,
        head): dimensions from its parameters, per-layer FLOPs, activation bytes and op counts from its op
        trace on ``batch`` x ``seq_len`` token ids (spec-only: nothing is allocated or computed)."""
        from autoparallel.planner.from_trace import from_trace

        return from_trace(model, seq_len, batch, name)


def _gpt(name, hidden, layers, heads, vocab=51200, seq_len=2048):
    return ModelSpec(name, hidden, layers, heads, vocab, seq_len=seq_len)


def _llama(name, hidden, layers, heads, kv_heads, ffn, vocab, seq_len):
    return ModelSpec(name, hidden, layers, heads, vocab, ffn=ffn, kv_heads=kv_heads, seq_len=seq_len, swiglu=True,
                     bias=False, layernorm=False, tied_embeddings=False, learned_positions=False, dropout=False)


# Megatron-LM weak-scaling rows (Narayanan et al. 2021, Table 1): name -> (hidden, layers, heads)
MEGATRON_ROWS = {
    "megatron-1.7b": (2304, 24, 24), "megatron-3.6b": (3072, 30, 32), "megatron-7.5b": (4096, 36, 32),
    "megatron-18b": (6144, 40, 48), "megatron-39b": (8192, 48, 64), "megatron-76b": (10240, 60, 80),
    "megatron-145b": (12288, 80, 96), "megatron-310b": (16384, 96, 128), "megatron-530b": (20480, 105, 128),
    "megatron-1t": (25600, 128, 160),
}

PRESETS = {
    # GPT-3 (Brown et al. 2020, Table 2.1); 1.3B uses 16 heads of 128, 13B the usual width 5120
    "gpt3-1.3b": _gpt("gpt3-1.3b", 2048, 24, 16),
    "gpt3-2.7b": _gpt("gpt3-2.7b", 2560, 32, 32),
    "gpt3-6.7b": _gpt("gpt3-6.7b", 4096, 32, 32),
    "gpt3-13b": _gpt("gpt3-13b", 5120, 40, 40),
    "gpt3-175b": _gpt("gpt3-175b", 12288, 96, 96),
    **{name: _gpt(name, *dims) for name, dims in MEGATRON_ROWS.items()},
    # LLaMA-2 (Touvron et al. 2023) and LLaMA-3 (Dubey et al. 2024)
    "llama2-7b": _llama("llama2-7b", 4096, 32, 32, 32, 11008, 32000, 4096),
    "llama2-13b": _llama("llama2-13b", 5120, 40, 40, 40, 13824, 32000, 4096),
    "llama2-70b": _llama("llama2-70b", 8192, 80, 64, 8, 28672, 32000, 4096),
    "llama3-8b": _llama("llama3-8b", 4096, 32, 32, 8, 14336, 128256, 8192),
    "llama3-70b": _llama("llama3-70b", 8192, 80, 64, 8, 28672, 128256, 8192),
    "llama3-405b": _llama("llama3-405b", 16384, 126, 128, 8, 53248, 128256, 8192),
    # published runs used to validate the planner (planner/published.py)
    "gpt-22b": _gpt("gpt-22b", 6144, 48, 64),
    "bloom-176b": ModelSpec("bloom-176b", 14336, 70, 112, 250880, learned_positions=False),       # ALiBi
    "opt-175b": _gpt("opt-175b", 12288, 96, 96, vocab=50272),
    # GPT-NeoX-20B as released (EleutherAI/gpt-neox configs/20B.yml): rotary, untied head, hidden and attention
    # dropout 0 (PyTorch's dropout with p = 0 returns its input: no mask is kept, no kernel runs)
    "gpt-neox-20b": ModelSpec("gpt-neox-20b", 6144, 44, 64, 50432, tied_embeddings=False, learned_positions=False,
                              dropout=False, parallel_block=True),
    "mt-nlg-530b": _gpt("mt-nlg-530b", 20480, 105, 128),
    # the 175B model of MegaScale's sweep (Jiang et al. 2024, Table 1 and §6.1): 128 heads, vocabulary 64,000 as
    # published (Megatron-LM would pad it to 64,512 at TP 8: +0.004% FLOPs; the paper's MFU counts 64,000)
    "megascale-175b": _gpt("megascale-175b", 12288, 96, 128, vocab=64000),
    # the 530B model of MegaScale's weak-scaling runs (Table 1: 160 heads, hidden 20480, 105 layers; §6.1)
    "megascale-530b": _gpt("megascale-530b", 20480, 105, 160, vocab=64000),
    # mixture of experts: Mixtral 8x7B (Jiang et al. 2024); DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437, and
    # deepseek-ai/DeepSeek-V3 config.json): MLA with 128 heads, q_lora_rank 1536, kv_lora_rank 512,
    # qk_nope_head_dim 128 + qk_rope_head_dim 64, v_head_dim 128 (§2.1.1, §4.2); the first 3 blocks dense
    # (first_k_dense_replace 3, intermediate_size 18432); 256 routed experts of 2048 (top-8) and 1 shared expert;
    # node-limited routing to 4 nodes (§2.1.2); multi-token prediction of depth 1 (§2.2, §4.2: "we set the MTP depth
    # D to 1"; config.json num_nextn_predict_layers 1)
    "mixtral-8x7b": ModelSpec("mixtral-8x7b", 4096, 32, 32, 32000, ffn=14336, kv_heads=8, seq_len=4096, swiglu=True,
                              bias=False, layernorm=False, tied_embeddings=False, learned_positions=False,
                              dropout=False, experts=8, top_k=2, expert_ffn=14336),
    "deepseek-v3": ModelSpec("deepseek-v3", 7168, 61, 128, 129280, ffn=18432, seq_len=4096, swiglu=True, bias=False,
                             layernorm=False, tied_embeddings=False, learned_positions=False, dropout=False,
                             experts=256, top_k=8, expert_ffn=2048, shared_experts=1, dense_layers=3,
                             route_nodes=4, qk_head_dim=192, v_head_dim=128, q_lora_rank=1536, kv_lora_rank=512,
                             qk_rope_head_dim=64, mtp_depth=1),
}

_INT_KEYS = {"hidden": "hidden", "layers": "layers", "heads": "heads", "vocab": "vocab", "ffn": "ffn",
             "kv_heads": "kv_heads", "seq": "seq_len", "seq_len": "seq_len", "experts": "experts", "top_k": "top_k",
             "expert_ffn": "expert_ffn", "shared_experts": "shared_experts", "dense_layers": "dense_layers",
             "qk_head_dim": "qk_head_dim", "v_head_dim": "v_head_dim", "q_lora_rank": "q_lora_rank",
             "kv_lora_rank": "kv_lora_rank", "qk_rope_head_dim": "qk_rope_head_dim", "mtp_depth": "mtp_depth"}
_BOOL_KEYS = ("swiglu",)
_ITEM = re.compile(r"^\s*([a-z_]+)\s*=\s*([0-9]+)\s*$")


def _share(item: str, spec: str) -> float:
    try:
        return float(item.split("=", 1)[1])
    except ValueError:
        raise ValueError(f"malformed model item {item!r} in {spec!r}: expected trainable=FRACTION (the share of the "
                         f"parameters that train, 0..1)") from None


def parse_model(spec) -> ModelSpec:
    """A ModelSpec from a preset name, an explicit dimension string, or a ModelSpec (returned as is).
    ``,trainable=0.003`` after either gives the share of the parameters that train (a LoRA run).

    Dimension strings: ``"hidden=8192,layers=48,heads=64,vocab=51200[,ffn=...,kv_heads=...,seq=...,swiglu=0|1]"``;
    hidden, layers, heads and vocab are required; swiglu=1 describes a LLaMA-style block (no biases,
    RMSNorm, untied head, no dropout), otherwise a GPT-style block; the mixture-of-experts, MLA
    (``kv_lora_rank=..,q_lora_rank=..,qk_head_dim=..,qk_rope_head_dim=..,v_head_dim=..``) and ``mtp_depth`` fields
    are integers too.
    """
    if isinstance(spec, ModelSpec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"expected a model preset name, a 'hidden=..,layers=..,heads=..,vocab=..' string or a "
                        f"ModelSpec, got {type(spec).__name__}")
    key = spec.strip().lower()
    share = [i.strip() for i in key.split(",") if i.strip().startswith("trainable=")]
    if share:                                   # "llama2-7b,trainable=0.003": a LoRA run of a preset or dimensions
        rest = ",".join(i for i in key.split(",") if i.strip() and not i.strip().startswith("trainable="))
        return replace(parse_model(rest), trainable_fraction=_share(share[-1], spec))
    if key in PRESETS:
        return PRESETS[key]
    if "=" not in key:
        raise ValueError(f"unknown model {spec!r}: expected a preset ({', '.join(sorted(PRESETS))}) or explicit "
                         f"dimensions like 'hidden=8192,layers=48,heads=64,vocab=51200'")
    values = {}
    for item in key.split(","):
        if not item.strip():
            continue
        m = _ITEM.match(item)
        if not m or (m.group(1) not in _INT_KEYS and m.group(1) not in _BOOL_KEYS):
            raise ValueError(f"malformed model item {item.strip()!r} in {spec!r}: expected KEY=INTEGER with KEY one "
                             f"of {sorted(set(_INT_KEYS) | set(_BOOL_KEYS))}")
        values[m.group(1)] = int(m.group(2))
    missing = [k for k in ("hidden", "layers", "heads", "vocab") if k not in values]
    if missing:
        raise ValueError(f"model string {spec!r} lacks {', '.join(missing)}: expected at least "
                         f"hidden=..,layers=..,heads=..,vocab=..")
    kwargs = {_INT_KEYS[k]: v for k, v in values.items() if k in _INT_KEYS}
    swiglu = bool(values.get("swiglu", 0))
    name = "custom"
    if swiglu:
        return ModelSpec(name, swiglu=True, bias=False, layernorm=False, tied_embeddings=False,
                         learned_positions=False, dropout=False, **kwargs)
    return ModelSpec(name, **kwargs)
