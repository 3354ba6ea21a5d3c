"""Optimizer updates (sgd, adamw): every per-element operand has the parameter's layout.

The signatures follow paddle's internal update ops (``paddle._C_ops.sgd_`` / ``adamw_``), which
paddle's optimizers call with local tensors. Gradients, moments and master weights are required in the
parameter's placements (a Partial gradient is thus reduced, or reduce-scattered onto a sharded
parameter, before the update); a Partial parameter is required R; learning rate, beta powers,
``found_inf`` and tensor hyper-parameters are R. Outputs mirror the op's outputs (None where the op
returns None). A block-sharded parameter (``S(d,blocks=..)``) keeps its layout: the update is per element.
"""
from __future__ import annotations

from autoparallel.core.placement import Partial
from autoparallel.core.spec import DistSpec

from spmd_rules.blocks import block_aware
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import R, check_spec


def _layout(op, param):
    check_spec(op, "param", param)
    return tuple(R if isinstance(p, Partial) else p for p in param.placements)


def _like(op, name, t, param, pl):
    if t is None:
        return None
    check_spec(op, name, t)
    if tuple(t.shape) != tuple(param.shape):
        raise ValueError(f"{op}: {name} must have the parameter's shape {list(param.shape)}, got {list(t.shape)}")
    return t.with_placements(pl)


def _replicated(t):
    return t.with_placements(tuple(R for _ in t.placements)) if isinstance(t, DistSpec) else None


@register_spmd_rule("sgd")
@block_aware
def sgd(param, learning_rate, grad, master_param=None, multi_precision=False):
    op = "sgd"
    pl = _layout(op, param)
    check_spec(op, "learning_rate", learning_rate)
    p = param.with_placements(pl)
    g = _like(op, "grad", grad, param, pl)
    mp = _like(op, "master_param", master_param, param, pl)
    inputs = [p, _replicated(learning_rate), g] + ([mp] if mp is not None else [])
    return SpmdResult(inputs, (p, mp))


@register_spmd_rule("adamw")
@block_aware
def adamw(param, grad, learning_rate, moment1, moment2, moment2_max, beta1_pow, beta2_pow, master_weight, found_inf,
          beta1=0.9, beta2=0.999, epsilon=1e-8, lr_ratio=1.0, coeff=0.01, with_decay=True, lazy_mode=False,
          min_row_size=1000, multi_precision=False, use_global_beta_pow=False, amsgrad=False):
    op = "adamw"
    pl = _layout(op, param)
    p = param.with_placements(pl)
    named = (("grad", grad), ("moment1", moment1), ("moment2", moment2), ("moment2_max", moment2_max),
             ("master_weight", master_weight))
    like = {n: _like(op, n, t, param, pl) for n, t in named}
    for n, t in (("learning_rate", learning_rate), ("beta1_pow", beta1_pow), ("beta2_pow", beta2_pow)):
        check_spec(op, n, t)
    inputs = [p, like["grad"], _replicated(learning_rate), like["moment1"], like["moment2"], like["moment2_max"],
              _replicated(beta1_pow), _replicated(beta2_pow), like["master_weight"], _replicated(found_inf),
              _replicated(beta1), _replicated(beta2), _replicated(epsilon)]
    outputs = (p, like["moment1"], like["moment2"], like["moment2_max"], _replicated(beta1_pow),
               _replicated(beta2_pow), like["master_weight"])
    return SpmdResult([s for s in inputs if s is not None], outputs)
