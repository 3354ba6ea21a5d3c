"""Multi-token prediction (DeepSeek-AI 2024, arXiv:2412.19437 §2.2): what its modules add to the last stage.

Each of ``model.mtp_depth`` modules runs after the main model's last block on the last pipeline stage (the stage
holding the output head it shares): norms of the previous depth's hidden state and of the next token's embedding,
their concatenation projected 2h -> h, one more block (``ModelSpec.mtp_block``: an MoE block when the model has
experts) and a second pass through the shared output head with its own cross-entropy. Time is priced in
cost_model.py (``mtp_seconds``), parameters in params.py (``mtp_params_on_device``), activations here.
"""
from __future__ import annotations

from autoparallel.planner import memory as mem


def mtp_activation_bytes(model, s, b, t, sp, recompute, scale=1.0, flash_attention=False,
                         store: mem.Storage = mem.DEFAULT_STORAGE):
    """Activations the modules keep on the last stage per micro-batch: each its block's (planner/memory.py), its
    fp32 logits (4·s·b·V/t) and the two normed inputs and their concatenation, 2·(2h) + 2·(2h) bytes per token
    (the norms' inputs and the projection's input), replicated under TP; ``store``: how the block caches its
    activations (planner/memory.py)."""
    if not model.mtp_depth:
        return 0.0
    block = mem.layer_activation_bytes(model.mtp_block(), s, b, t, sp, recompute, scale, flash_attention, store)
    inputs = scale * 8.0 * s * b * model.hidden
    return model.mtp_depth * (block + mem.logits_bytes(model, s, b, t) + inputs)
