"""ZeRO stage 3 parameter life cycle: a parameter holds no data between uses.

Around every layer that owns managed parameters:
  forward pre-hook   all_gather the layer's parameters from their chunks;
  forward post-hook  release them; when autograd will need them, a hook on the layer's outputs gathers
                     them again as soon as the outputs' gradient arrives (before the layer's own backward
                     runs) and a hook on the layer's inputs releases them once the gradient of the inputs
                     is complete (the layer's backward is done). Whatever is still whole is released by
                     the optimizer step.
Autograd keeps references to the parameter tensor objects; their storage is released and re-filled in
place, so those references see the gathered data again.
"""
from __future__ import annotations

import weakref

import paddle

from autoparallel.dist_tensor import DistTensor
from autoparallel.dist_tensor_forms import ZERO3_OWNERS


def install_stage3(model, zopt) -> list:
    managed = {id(p) for p in zopt.params}
    for p in zopt.params:            # reading a released parameter (full(), numpy()) gathers it through zopt
        ZERO3_OWNERS.set(p, weakref.ref(zopt))
    handles = []
    for _, layer in [("", model)] + list(model.named_sublayers()):
        own = [p for p in layer.parameters(include_sublayers=False) if id(p) in managed]
        if not own:
            continue
        handles.append(layer.register_forward_pre_hook(_pre(zopt, own)))
        handles.append(layer.register_forward_post_hook(_post(zopt, own)))
    zopt.free(zopt.params)
    return handles


def _pre(zopt, own):
    def hook(_layer, _inputs):
        zopt.gather(own)
    return hook


def _post(zopt, own):
    def hook(_layer, inputs, outputs):
        if paddle.is_grad_enabled():
            outs = [t for t in _tensors(outputs) if not t.stop_gradient]
            if outs:
                for t in outs:
                    t.register_hook(lambda g: zopt.gather(own))
                for t in _tensors(inputs):
                    if not t.stop_gradient:
                        t.register_hook(lambda g: zopt.free(own))
        zopt.free(own)
    return hook


def _tensors(x) -> list:
    if isinstance(x, DistTensor):
        return list(x.locals.values())
    if isinstance(x, paddle.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []
