"""paddle's gradient clips per parameter group.

An optimizer built over parameter groups (``parameters=[{"params": a}, {"params": b, "grad_clip": c}]``)
clips each group by that group's own ``grad_clip`` (a group without one takes the optimizer's): a
``ClipGradByGlobalNorm`` is then the norm over the group's gradients, not over the whole model, and the
optimizer's ``_grad_clip`` is not read at all. Without groups the optimizer's clip covers every parameter.
The ap optimizers clip distributed gradients themselves (whole-tensor norms, parallel/clip.py) and switch
paddle's own norm clips off for the step, where paddle would see only this rank's shards: both the
optimizer's and every group's (``suspend``).
"""
from __future__ import annotations

from autoparallel.parallel.param_list import flat_params


def has_groups(opt) -> bool:
    groups = getattr(opt, "_param_groups", None)
    return bool(groups) and isinstance(groups[0], dict)


def clip_sets(opt) -> list:
    """[(clip or None, [parameters])] as paddle clips them: one entry per group, or one over every parameter."""
    if has_groups(opt):
        return [(g.get("grad_clip"), list(g["params"])) for g in opt._param_groups]
    return [(getattr(opt, "_grad_clip", None), list(flat_params(opt)))]


class Suspended:
    """Clips switched off on an optimizer (its ``_grad_clip`` and its groups' ``grad_clip``) until ``restore``."""

    def __init__(self, opt, clips):
        ids = {id(c) for c in clips}
        self._opt, self._own = opt, getattr(opt, "_grad_clip", None)
        self._groups = [(g, g.get("grad_clip")) for g in (opt._param_groups if has_groups(opt) else [])]
        if id(self._own) in ids:
            opt._grad_clip = None
        for g, c in self._groups:
            if id(c) in ids:
                g["grad_clip"] = None

    def restore(self) -> None:
        self._opt._grad_clip = self._own
        for g, c in self._groups:
            g["grad_clip"] = c


def suspend(opt, clips) -> Suspended:
    """Switch ``clips`` off wherever ``opt`` holds them (the optimizer's own clip, its groups')."""
    return Suspended(opt, clips)
