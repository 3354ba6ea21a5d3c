"""``paddle.nn.utils`` helpers that read or write parameters' gradients or values as whole local tensors
(``clip_grad_norm_``, ``clip_grad_value_``, ``parameters_to_vector``, ``vector_to_parameters``). Given a
distributed parameter they would see one shard and, between ``backward()`` and the optimizer step, a
data-parallel gradient possibly still partial, so their result would be wrong without a sign. The two clips
run distributed (parallel/hand_clip.py: gradients reduced first, norms over whole gradients); the others,
and the clips where the gradients are not in ``p.grad`` (ZeRO), raise, naming what does the same job: the
optimizer's ``grad_clip`` or ``.full()``."""
from __future__ import annotations

import sys

from autoparallel import patches
from autoparallel.dist_tensor import is_dist

_INSTEAD = {
    "clip_grad_norm_": "build the optimizer with grad_clip=paddle.nn.ClipGradByGlobalNorm(max_norm) (or "
                       "ClipGradByNorm): it clips the reduced, whole gradients at the step",
    "clip_grad_value_": "build the optimizer with grad_clip=paddle.nn.ClipGradByValue(clip_value): it clips "
                        "the reduced gradients at the step",
    "parameters_to_vector": "gather each parameter with p.full() and concatenate those",
    "vector_to_parameters": "set each distributed parameter with p.set_value(global value)",
}


def _first_dist(args, kwargs):
    for v in list(args) + list(kwargs.values()):
        items = [v] if is_dist(v) else (list(v) if isinstance(v, (list, tuple)) else [])
        for p in items:
            if is_dist(p):
                return p
    return None


def _refusing(name, orig):
    def wrapper(*args, **kwargs):
        if args and not isinstance(args[0], (list, tuple)) and hasattr(args[0], "__iter__") \
                and not is_dist(args[0]) and name != "vector_to_parameters":
            args = (list(args[0]),) + tuple(args[1:])       # a generator (model.parameters()) read once
        if name == "vector_to_parameters" and len(args) > 1 and not isinstance(args[1], (list, tuple)):
            args = (args[0], list(args[1])) + tuple(args[2:])
        p = _first_dist(args, kwargs)
        if p is None:
            return orig(*args, **kwargs)
        if name in ("clip_grad_norm_", "clip_grad_value_"):        # reduced first, then whole-gradient math
            from autoparallel.parallel import hand_clip

            return getattr(hand_clip, name)(*args, instead=_INSTEAD[name], **kwargs)
        raise NotImplementedError(f"paddle.nn.utils.{name} over the distributed parameter {p.name} would read one "
                                  f"shard ({', '.join(map(str, p.placements))}) and a gradient not yet reduced; "
                                  f"{_INSTEAD[name]}")
    wrapper.__wrapped__ = orig
    wrapper.__name__ = name
    wrapper._ap_wrapper = True
    return wrapper


def install() -> None:
    import paddle.nn.utils as utils

    for name in _INSTEAD:
        orig = getattr(utils, name, None)
        if orig is None or getattr(orig, "_ap_wrapper", False):
            continue
        w = _refusing(name, orig)
        patches.patch(utils, name, w)
        for mod_name in ("paddle.nn.utils.clip_grad_norm_", "paddle.nn.utils.clip_grad_value_",
                         "paddle.nn.utils.transform_parameters"):
            mod = sys.modules.get(mod_name)
            if mod is not None and getattr(mod, name, None) is orig:
                patches.patch(mod, name, w)
