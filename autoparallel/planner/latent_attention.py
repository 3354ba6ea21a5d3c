"""Multi-head latent attention and multi-token prediction: the DeepSeek-V2/V3 parts of ModelSpec.

``LatentAttentionShapes`` holds ModelSpec's properties for attention heads whose query/key and value widths differ
from hidden/heads, for MLA's low-rank query and key/value projections (``kv_lora_rank`` > 0; DeepSeek-AI 2024,
arXiv:2412.19437 §2.1.1) and for multi-token-prediction modules (``mtp_depth``, §2.2); ``mla_fields`` reads
those widths and ranks from a model's config. Nothing here imports the rest of the planner.
"""
from __future__ import annotations

from dataclasses import replace


class LatentAttentionShapes:
    """Mixin of ModelSpec (a frozen dataclass with the fields ``qk_head_dim``, ``v_head_dim``, ``q_lora_rank``,
    ``kv_lora_rank``, ``qk_rope_head_dim`` and ``mtp_depth``)."""

    def _check_mla(self):
        for name in ("qk_head_dim", "v_head_dim", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "mtp_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"model {self.name!r}: {name} must be a non-negative integer, got {value!r}")
        if not self.is_mla:
            if self.q_lora_rank or self.qk_rope_head_dim:
                raise ValueError(f"model {self.name!r}: q_lora_rank and qk_rope_head_dim describe multi-head latent "
                                 f"attention and need kv_lora_rank > 0, got kv_lora_rank=0")
            return
        if self.kv_heads != self.heads:
            raise ValueError(f"model {self.name!r}: multi-head latent attention projects keys and values up per "
                             f"query head, so kv_heads must equal heads ({self.heads}), got {self.kv_heads}")
        if self.qk_rope_head_dim >= self.qk_dim:
            raise ValueError(f"model {self.name!r}: qk_rope_head_dim ({self.qk_rope_head_dim}) must be smaller than "
                             f"the query/key head width ({self.qk_dim}): the rest is the latent's per-head part")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_dim(self) -> int:
        """Width of one query/key head: qk_head_dim, else head_dim."""
        return self.qk_head_dim or self.head_dim

    @property
    def v_dim(self) -> int:
        """Width of one value head: v_head_dim, else head_dim."""
        return self.v_head_dim or self.head_dim

    @property
    def attention_params(self) -> tuple:
        """(TP-split, replicated) parameters of the attention's matmuls, with d_qk / d_v the head widths:
        q h·a·d_qk + k h·kv·d_qk + v h·kv·d_v + out a·d_v·h, nothing replicated; MLA: q_b r_q·a·d_qk (or a full-rank
        q) + kv_b r_kv·a·(d_qk - d_rope + d_v) + out split, q_a h·r_q + kv_a h·(r_kv + d_rope) replicated."""
        h, a, kv, dqk, dv = self.hidden, self.heads, self.kv_heads, self.qk_dim, self.v_dim
        out = a * dv * h
        if not self.is_mla:
            return h * a * dqk + h * kv * dqk + h * kv * dv + out, 0
        r_q, r_kv, rope = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim
        q_split, q_down = (r_q * a * dqk, h * r_q) if r_q else (h * a * dqk, 0)
        return q_split + r_kv * a * (dqk - rope + dv) + out, q_down + h * (r_kv + rope)

    @property
    def up_projection_params(self) -> int:
        """MLA's up-projections: q_b r_q·a·d_qk (0 for a full-rank query) + kv_b r_kv·a·(d_qk - d_rope + d_v)."""
        if not self.is_mla:
            return 0
        a, dqk = self.heads, self.qk_dim
        q_up = self.q_lora_rank * a * dqk
        return q_up + self.kv_lora_rank * a * (dqk - self.qk_rope_head_dim + self.v_dim)

    @property
    def latent_norm_params(self) -> int:
        """MLA's norms of the query and key/value latents (weight only): r_q + r_kv."""
        return self.q_lora_rank + self.kv_lora_rank if self.is_mla else 0

    def layer_replicated_flops_per_token(self) -> float:
        """2·(h·r_q + h·(r_kv + d_rope)): MLA's down-projections, which every TP rank runs whole (0 otherwise)."""
        return 2.0 * self.attention_params[1]

    def attention_core_flops_per_token(self, seq_len: int) -> float:
        """2·s·a·(d_qk + d_v), 4·s·h for heads of width h/a: scores QK^T over all s keys and their product with V,
        the part of a block's forward that selective recomputation runs again."""
        return 2.0 * seq_len * self.heads * (self.qk_dim + self.v_dim)

    # ---- multi-token prediction (DeepSeek-AI 2024 §2.2) --------------------------------------------
    def mtp_block(self) -> "LatentAttentionShapes":
        """One block of a multi-token-prediction module as a one-block model: an MoE block when the model has
        experts (DeepSeek-V3's released weights: layer 61 holds experts), else a dense block."""
        return replace(self, name=self.name + "-mtp-block", layers=1, dense_layers=0, mtp_depth=0)

    @property
    def mtp_projection_params(self) -> int:
        """The module's projection of [norm(h_prev); norm(embedding)] (2h) to h: 2·h·h."""
        return 2 * self.hidden * self.hidden

    @property
    def mtp_module_params(self) -> float:
        """Parameters of one module: its block, the 2h x h projection and three norms (the two inputs' and the
        output's before the shared head); the embedding and output head are the main model's."""
        block = self.mtp_block()
        norms = 3 * (2 * self.hidden if self.layernorm else self.hidden)
        return block.layer_params + block.layer_expert_params + self.mtp_projection_params + norms

    def mtp_forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs of the multi-token-prediction modules: each its block, the 2h x h projection and a second
        output-head pass (2·h·V)."""
        per_module = (self.mtp_block().layer_forward_flops_per_token(seq_len) + 2.0 * self.mtp_projection_params
                      + self.logits_forward_flops_per_token())
        return self.mtp_depth * per_module


MLA_CONFIG = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")   # DeepSeek-V2/V3


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def mla_fields(model, heads: int) -> dict:
    """ModelSpec's multi-head latent attention fields from ``model.config`` (the DeepSeek-V2/V3 names of
    ``MLA_CONFIG``) when it sets ``kv_lora_rank``, else {}; ``q_lora_rank`` None or 0 is a full-rank query."""
    c = getattr(model, "config", None)
    if not _positive(getattr(c, "kv_lora_rank", None)):
        return {}
    missing = [k for k in MLA_CONFIG[2:] if not _positive(getattr(c, k, None))]
    if missing:
        raise ValueError(f"model.config of {type(model).__name__} sets kv_lora_rank (multi-head latent attention) but "
                         f"lacks positive {', '.join(missing)}; expected all of {', '.join(MLA_CONFIG[2:])}")
    q_rank = getattr(c, "q_lora_rank", None)
    if q_rank is not None and not (_positive(q_rank) or q_rank == 0):
        raise ValueError(f"model.config.q_lora_rank must be a positive integer, 0 or None (a full-rank query), got "
                         f"{q_rank!r}")
    return {"kv_lora_rank": c.kv_lora_rank, "q_lora_rank": q_rank or 0, "qk_rope_head_dim": c.qk_rope_head_dim,
            "qk_head_dim": c.qk_nope_head_dim + c.qk_rope_head_dim, "v_head_dim": c.v_head_dim, "kv_heads": heads}
