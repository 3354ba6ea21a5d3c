"""The parameters a paddle optimizer updates, its parameter groups (dicts with "params") flattened."""
from __future__ import annotations


def flat_params(optimizer):
    """Every parameter of ``optimizer._parameter_list`` in order, groups flattened (none when it has no list)."""
    for p in getattr(optimizer, "_parameter_list", None) or []:
        if isinstance(p, dict):
            yield from p["params"]
        else:
            yield p


def rebind_params(optimizer, replaced: dict) -> None:
    """Point ``optimizer``'s parameter list (and its groups) at ``replaced`` ({id(old): new}) in place."""
    params = optimizer._parameter_list
    if params and isinstance(params[0], dict):           # parameter groups
        for group in params:
            group["params"] = [replaced.get(id(p), p) for p in group["params"]]
        for group in getattr(optimizer, "_param_groups", []) or []:
            if isinstance(group, dict):
                group["params"] = [replaced.get(id(p), p) for p in group["params"]]
        return
    optimizer._parameter_list = [replaced.get(id(p), p) for p in params]
    groups = getattr(optimizer, "_param_groups", None)
    if groups is not None and groups and not isinstance(groups[0], dict):
        optimizer._param_groups = list(optimizer._parameter_list)
