"""The parameters a paddle optimizer updates, its parameter groups (dicts with "params") flattened."""
from __future__ import annotations


def flat_params(optimizer):
    """Every parameter of ``optimizer._parameter_list`` in order, groups flattened (none when it has no list)."""
    for p in getattr(optimizer, "_parameter_list", None) or []:
        if isinstance(p, dict):
            yield from p["params"]
        else:
            yield p
