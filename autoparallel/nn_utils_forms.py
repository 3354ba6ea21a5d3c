"""``paddle.nn.utils`` helpers that read or write parameters' gradients or values as whole local tensors
(``clip_grad_norm_``, ``clip_grad_value_``, ``parameters_to_vector``, ``vector_to_parameters``). Given a
distributed parameter they would see one shard and, between ``backward()`` and the optimizer step, a
data-parallel gradient possibly still partial, so their result would be wrong without a sign. The two clips
run distributed (parallel/hand_clip.py: gradients reduced first, norms over whole gradients); the others,
and the clips where the gradients are not in ``p.grad`` (ZeRO), raise, naming what does the same job: the
optimizer's ``grad_clip`` or ``.full()``.

``paddle.nn.utils.weight_norm``'s pre-hook recomputes ``weight = g * v / ||v||`` before each forward and stores
it in the layer's buffer slot, which takes only a dense tensor; computed from distributed ``g`` / ``v`` it is a
distributed tensor, kept as the layer's plain attribute instead (the buffer slot emptied), so the layer's
``F.linear`` / ``F.conv2d`` reads it. ``spectral_norm``'s hook likewise; its power iteration (no gradient)
updates the plain ``u`` / ``v`` buffers from the whole weight, as one process does."""
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
        if name in ("parameters_to_vector", "vector_to_parameters"):   # global values, as one process
            from autoparallel import param_vector

            return getattr(param_vector, name)(*args, **kwargs)
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
    _install_weight_norm()


def _weight_norm_call(orig):
    def __call__(self, layer, inputs):
        w = self.compute_weight(layer)
        if not is_dist(w):
            return orig(self, layer, inputs)
        layer._buffers.pop(self.name, None)
        object.__setattr__(layer, self.name, w)
        return None

    __call__.__wrapped__ = orig
    __call__._ap_wrapper = True
    return __call__


def _install_weight_norm() -> None:
    from paddle.nn.utils.weight_norm_hook import WeightNorm

    from paddle.nn.utils.spectral_norm_hook import SpectralNorm

    for cls, wrap in ((WeightNorm, _weight_norm_call), (SpectralNorm, _spectral_norm_call)):
        orig = cls.__call__
        if not getattr(orig, "_ap_wrapper", False):
            patches.patch(cls, "__call__", wrap(orig))


def _spectral_norm_call(orig):
    def __call__(self, layer, inputs):
        import paddle
        import paddle.nn.functional as F

        w = getattr(layer, self.name + "_orig")
        if not is_dist(w):
            return orig(self, layer, inputs)
        u, v = getattr(layer, self.name + "_u"), getattr(layer, self.name + "_v")
        if layer.training:
            from autoparallel.local_mode import local_mode

            whole = w.full()
            with paddle.no_grad(), local_mode():       # plain tensors (a replicated weight's own storage too)
                mat = self.reshape_weight_to_matrix(whole)
                for _ in range(self.n_power_iterations):
                    paddle.assign(F.normalize(paddle.matmul(mat, u, transpose_x=True), axis=0, epsilon=self.eps), v)
                    paddle.assign(F.normalize(paddle.matmul(mat, v), axis=0, epsilon=self.eps), u)
            u, v = u.clone(), v.clone()
        sigma = paddle.dot(u, paddle.mv(self.reshape_weight_to_matrix(w), v))
        layer._buffers.pop(self.name, None)
        object.__setattr__(layer, self.name, w / sigma)
        return None

    __call__.__wrapped__ = orig
    __call__._ap_wrapper = True
    return __call__
