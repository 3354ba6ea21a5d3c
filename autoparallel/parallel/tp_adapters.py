"""Low-rank adapters (LoRA) under tensor parallelism: the adapter is split like the Linear it adapts.

A LoRA layer adds ``x @ A @ B * scale`` to a Linear's output, ``A [in, r]`` and ``B [r, out]`` (paddle's
``[in, out]`` order). Two forms are recognised, by shape, whatever the parameters are called:

* the Linear itself holds the pair (PaddleFormers' ``LoRALinear`` subclasses ``paddle.nn.Linear`` and adds
  ``lora_A`` / ``lora_B``);
* a wrapper layer holds the pair and exactly one child, the base ``Linear`` (a hand-written LoRA layer).

Column-parallel splits ``B`` on its output dim exactly as the base weight's output dim (``S(1)``, or the
same blocks for a fused projection), so ``x @ A @ B`` is computed on the local output columns with no
collective; row-parallel splits ``A`` on its input dim like the base weight (``S(0)``), so ``x @ A`` is a
partial sum reduced by the base output's one all_reduce. The rank dim ``r`` is never split. A layout is a
communication choice, never a value choice: an adapter left replicated (a user's shard function that splits
only the base weight) computes the same values, with an all_gather of B's gradient per step.
"""
from __future__ import annotations

_RESERVED = ("weight", "bias")


def base_linear(layer):
    """The ``paddle.nn.Linear`` that ``layer`` adapts: ``layer`` itself, or the only child of a wrapper that
    holds an adapter pair; None when ``layer`` is neither."""
    from paddle import nn

    if isinstance(layer, nn.Linear):
        return layer
    kids = list(layer.children())
    if len(kids) == 1 and isinstance(kids[0], nn.Linear) and _pair(layer, kids[0]) is not None:
        return kids[0]
    return None


def is_adapter_wrapper(layer) -> bool:
    """A layer holding a LoRA pair and, as its only child, the base Linear."""
    base = base_linear(layer)
    return base is not None and base is not layer


def _shape(p):
    return list(getattr(p, "global_shape", p.shape))


def _pair(holder, base):
    """(name of A [in, r], name of B [r, out]) among ``holder``'s own 2-D parameters, when exactly one such
    pair exists for ``base``'s weight ``[in, out]``; else None."""
    w = base._parameters.get("weight")
    if w is None or len(_shape(w)) != 2:
        return None
    n_in, n_out = _shape(w)
    own = {n: _shape(p) for n, p in holder._parameters.items()
           if p is not None and n not in _RESERVED and len(_shape(p)) == 2}
    pairs = [(a, b) for a, sa in own.items() for b, sb in own.items()
             if a != b and sa[0] == n_in and sb[1] == n_out and sa[1] == sb[0]]
    return pairs[0] if len(pairs) == 1 else None


def adapter_targets(layer, weight_placement, column: bool) -> list:
    """[(holder, parameter name, placement)] for the adapter of ``layer`` under a style whose base weight
    takes ``weight_placement``: column-parallel gives it to B (its output dim is dim 1 like the weight's),
    row-parallel to A (its input dim is dim 0 like the weight's)."""
    base = base_linear(layer)
    if base is None:
        return []
    pair = _pair(layer, base)
    if pair is None:
        return []
    return [(layer, pair[1] if column else pair[0], weight_placement)]


__all__ = ["base_linear", "is_adapter_wrapper", "adapter_targets"]
