"""Parameters one device holds: a block, the embedding and head, and a pipeline stage, before ZeRO.

Notation as in planner/memory.py: t TP degree, e expert-parallel degree, p PP degree, Ψ parameters. Every
function works on numpy arrays (one element per candidate) as well as on scalars.
"""
from __future__ import annotations

import numpy as np


def layer_params_on_device(model, t, e=1):
    """Ψ of one block on one device: TP-split matmuls and column biases, replicated norms and row biases,
    routed experts split over e·t."""
    col_bias = model.layer_column_bias_params
    dense = (model.layer_matmul_params + col_bias) / t + model.layer_other_params - col_bias
    return dense + model.layer_expert_params / (np.asarray(t) * np.asarray(e))


def edge_params(model, t):
    """(embedding Ψ, head Ψ without the tied copy) on one device."""
    h, V = model.hidden, model.vocab
    norm = model.head_params - (0 if model.tied_embeddings else V * h)
    head_untied = 0.0 if model.tied_embeddings else V * h / t
    return V * h / t + model.position_params, head_untied + norm


def block_and_edge_params(model, tp, pp, ep):
    """(dense Ψ of one block, routed-expert Ψ of one block, first stage's edge Ψ, last stage's edge Ψ) on one
    device: the embedding on the first stage, the head (and a tied head's copy when p > 1) on the last, with the
    multi-token-prediction modules (their routed experts counted with the edge, i.e. sharded over dp by ZeRO)."""
    layer_dense = layer_params_on_device(model, tp, 1) - model.layer_expert_params / tp
    layer_expert = model.layer_expert_params / (tp * ep)
    emb, head = edge_params(model, tp)
    head = head + mtp_params_on_device(model, tp, ep)      # multi-token prediction sits with the head (planner/mtp.py)
    head_copy = np.where(model.tied_embeddings & (pp > 1), model.vocab * model.hidden / tp, 0.0)
    edge_first = np.where(pp == 1, emb + head, emb)
    edge_last = np.where(pp == 1, emb + head, head + head_copy)
    return layer_dense, layer_expert, edge_first, edge_last


def largest_stage_params(n_first, n_last, n_mid, layer_psi, edge_first, edge_last):
    """Ψ of the stage holding most: n_i blocks of ``layer_psi`` each plus its edge (embedding or head)."""
    return np.maximum.reduce([n_first * layer_psi + edge_first, n_last * layer_psi + edge_last, n_mid * layer_psi])


def stage_params(model, t, p, first_layers=None, last_layers=None, e=1):
    """(Ψ of the first stage, Ψ of the last stage, Ψ of one block) on one device, before ZeRO.

    Blocks per stage default to ceil(l/p); TP splits the matmuls, the column-parallel biases and the
    vocabulary; expert parallelism (degree e) and TP split the routed experts; the first stage holds the
    embedding, the last the output head (a tied head is a copy when p > 1).
    """
    p = np.asarray(p)
    per_stage = -(-model.layers // p)
    first_layers = per_stage if first_layers is None else first_layers
    last_layers = per_stage if last_layers is None else last_layers
    layer_dense, layer_expert, edge_first, edge_last = block_and_edge_params(model, t, p, e)
    layer_psi = layer_dense + layer_expert
    return first_layers * layer_psi + edge_first, last_layers * layer_psi + edge_last, layer_psi


def mtp_params_on_device(model, t, e=1):
    """Ψ of the modules on one device of the last stage: each block's (TP-split, routed experts over e·t), the
    2h x h projection over t, three norms replicated. 0 without multi-token prediction."""
    if not model.mtp_depth:
        return 0.0
    block = model.mtp_block()
    norms = model.mtp_module_params - block.layer_params - block.layer_expert_params - model.mtp_projection_params
    per_module = layer_params_on_device(block, t, e) + model.mtp_projection_params / np.asarray(t) + norms
    return model.mtp_depth * per_module
