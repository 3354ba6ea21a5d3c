"""Multi-token prediction (DeepSeek-AI 2024, arXiv:2412.19437 §2.2): what its modules add to the last stage.

Each of ``model.mtp_depth`` modules runs after the main model's last block on the last pipeline stage (the stage
holding the output head it shares): norms of the previous depth's hidden state and of the next token's embedding,
their concatenation projected 2h -> h, one more block (``ModelSpec.mtp_block``: an MoE block when the model has
experts) and a second pass through the shared output head with its own cross-entropy. Time is priced in
cost_model.py (``mtp_seconds``); parameters and activations here. Every function works on numpy arrays.
"""
from __future__ import annotations

import numpy as np

from autoparallel.planner import memory as mem
from autoparallel.planner.params import layer_params_on_device


def mtp_params_on_device(model, t, e=1):
    """Ψ of the modules on one device of the last stage: each block's (TP-split, routed experts over e·t), the
    2h x h projection over t, three norms replicated. 0 without multi-token prediction."""
    if not model.mtp_depth:
        return 0.0
    block = model.mtp_block()
    norms = model.mtp_module_params - block.layer_params - block.layer_expert_params - model.mtp_projection_params
    per_module = layer_params_on_device(block, t, e) + model.mtp_projection_params / np.asarray(t) + norms
    return model.mtp_depth * per_module


def mtp_activation_bytes(model, s, b, t, sp, recompute, scale=1.0, flash_attention=False):
    """Activations the modules keep on the last stage per micro-batch: each its block's (planner/memory.py), its
    fp32 logits (4·s·b·V/t) and the two normed inputs and their concatenation, 2·(2h) + 2·(2h) bytes per token
    (the norms' inputs and the projection's input), replicated under TP."""
    if not model.mtp_depth:
        return 0.0
    block = mem.layer_activation_bytes(model.mtp_block(), s, b, t, sp, recompute, scale, flash_attention)
    inputs = scale * 8.0 * s * b * model.hidden
    return model.mtp_depth * (block + mem.logits_bytes(model, s, b, t) + inputs)
