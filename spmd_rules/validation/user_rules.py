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


def _single(args) -> bool:
    return any(isinstance(a, T) and a.array.dtype.itemsize <= 4 and np.issubdtype(a.array.dtype, np.floating)
               for a in args)


def check_user_rule(op: str, impl, *args, rtol=None, atol=None, **kwargs) -> list:
    """Failures (strings naming the layout and the error) of rule ``op`` on ``impl(*args, **kwargs)``; arrays and
    tensors among the arguments are the sample tensors, other values are passed as they are. Tolerances default
    to 1e-5 / 1e-8 for float64 samples and 1e-4 / 1e-5 when a sample is float32 or narrower."""
    _build_cases()
    args = [_arg(a) for a in args]
    kwargs = {k: _arg(v) for k, v in kwargs.items()}
    single = _single(args + list(kwargs.values()))
    rtol = rtol if rtol is not None else (1e-4 if single else 1e-5)
    atol = atol if atol is not None else (1e-5 if single else 1e-8)
    saved = CASES.pop(op, None)
    try:
        add_case(op, *args, impl=impl, rtol=rtol, atol=atol, **kwargs)
        outcome = check_op(op)
    finally:
        CASES.pop(op, None)
        if saved is not None:
            CASES[op] = saved
    if outcome.no_rule:
        return [f"{op}: no rule registered (register_spmd_rule({op!r}))"]
    return list(outcome.failures)
