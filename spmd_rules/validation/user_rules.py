"""Check a user's own rule against the user's own function before training with it.

The runtime trusts a registered rule: a rule claiming ``Shard(0)`` for a function that reduces over dim 0 runs,
and each rank computes on its rows only (wrong values, no error). ``check_user_rule`` runs the rule checker on
one sample call: every layout of the sample's tensors on 1-d meshes of 2 and 3 ranks and sampled 2x2 layouts,
values and input gradients against the function on the whole tensors::

    from spmd_rules.validation.user_rules import check_user_rule
    failures = check_user_rule("my_op", my_function, np.random.rand(4, 8))     # [] when the rule holds
"""
from __future__ import annotations

import numpy as np

from .case import CASES, T, add_case
from .driver import check_op
from .samples import _build_cases


def _arg(v):
    if isinstance(v, T):
        return v
    if hasattr(v, "numpy") and callable(v.numpy):
        return T(np.asarray(v.numpy()))
    if isinstance(v, np.ndarray):
        return T(v)
    return v


def check_user_rule(op: str, impl, *args, **kwargs) -> list:
    """Failures (strings naming the layout and the error) of rule ``op`` on ``impl(*args, **kwargs)``; arrays and
    tensors among the arguments are the sample tensors, other values are passed as they are."""
    _build_cases()
    saved = CASES.pop(op, None)
    try:
        add_case(op, *[_arg(a) for a in args], impl=impl, **{k: _arg(v) for k, v in kwargs.items()})
        outcome = check_op(op)
    finally:
        CASES.pop(op, None)
        if saved is not None:
            CASES[op] = saved
    if outcome.no_rule:
        return [f"{op}: no rule registered (register_spmd_rule({op!r}))"]
    return list(outcome.failures)
