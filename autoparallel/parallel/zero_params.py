"""ZeRO stage 3 parameter life cycle: a parameter holds no data between uses.

Around every layer that owns managed parameters:
  forward pre-hook   all_gather the layer's parameters from their chunks;
  forward post-hook  release them; when autograd will need them, a hook on the layer's outputs gathers
                     them again as soon as the outputs' gradient arrives (before the layer's own backward
                     runs) and a hook on the layer's inputs releases them once the gradient of the inputs
                     is complete (the layer's backward is done). A layer run several times before one
                     backward (two forwards summed, a block applied twice) is released after the last
                     of those backwards. Whatever is still whole is released by the optimizer step.
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
    zopt.stage3_uses = {}            # id(layer) -> forward uses whose backward has not finished
    for _, layer in [("", model)] + list(model.named_sublayers()):
        own = [p for p in layer.parameters(include_sublayers=False) if id(p) in managed]
        if not own:
            continue
        handles.append(layer.register_forward_pre_hook(_pre(zopt, own)))
        handles.append(layer.register_forward_post_hook(_post(zopt, own, id(layer))))
    zopt.free(zopt.params)
    return handles


def _pre(zopt, own):
    def hook(_layer, _inputs):
        zopt.gather(own)
    return hook


def _running_stats(layer, own) -> list:
    """The parameters a training forward of ``layer`` updates in place: a batch norm's running mean and variance
    (non-trainable parameters of paddle's batch norm layers)."""
    norms = (paddle.nn.BatchNorm, paddle.nn.BatchNorm1D, paddle.nn.BatchNorm2D, paddle.nn.BatchNorm3D,
             paddle.nn.SyncBatchNorm)
    return [p for p in own if p.stop_gradient] if isinstance(layer, norms) else []


def _post(zopt, own, key):
    def hook(_layer, inputs, outputs):
        stats = _running_stats(_layer, own) if _layer.training else []
        if stats and not _REPLAYS[0]:   # the update reaches the chunks before the gathered copy is released;
            # a recompute re-run in backward repeats the forward's update, which the chunks already hold
            zopt.reload(stats)
        escaped = _returned(outputs, own)
        if paddle.is_grad_enabled():
            mine = {id(t) for p in own if id(p) in escaped for t in _tensors(p)}     # no hook piling up on a leaf
            outs = [t for t in _tensors(outputs) if not t.stop_gradient and id(t) not in mine]
            ins = [t for t in _tensors(inputs) if not t.stop_gradient]
            if outs:
                for t in outs:
                    t.register_hook(lambda g: zopt.gather(own))
                if ins:
                    release = _release_after_backward(zopt, own, key, len(ins))
                    for t in ins:
                        t.register_hook(release)
        if not _HOLDS[0]:               # a live create_graph gradient reads them in a later backward: kept whole
            zopt.free([p for p in own if id(p) not in escaped] if escaped else own)
    return hook


def _returned(outputs, own) -> set:
    """ids of the parameters of ``own`` the layer returns as (part of) its output: their reader runs after the layer
    (PaddleFormers' LM head hands its weight to the fused head-and-loss PyLayer), so they stay gathered until the
    optimizer step releases them."""
    ids = {id(p) for p in own}
    found, stack = set(), [outputs]
    while stack:
        x = stack.pop()
        if id(x) in ids:
            found.add(id(x))
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return found


def _release_after_backward(zopt, own, key, n: int = 1):
    """The hook on the ``n`` input tensors of one use (every held rank's): ``own`` is released once all ``n``
    gradients arrived (the layer's backward is over on every held rank; one rank's input gradient arriving
    first must not release the other ranks' parameters in the simulated world) and no other use's backward
    needs them. An input whose hook never fires (``paddle.grad`` with it as a target) leaves ``own`` gathered
    until the step releases it."""
    uses = zopt.stage3_uses
    uses[key] = uses.get(key, 0) + 1
    done = []

    def release(_g):
        done.append(True)
        if len(done) == n:
            uses[key] -= 1
            if uses[key] <= 0 and not _HOLDS[0]:
                zopt.free(own)
    return release


_HOLDS = [0]            # live create_graph gradients: their graph reads the parameters again (hold them whole)
_REPLAYS = [0]          # recompute re-runs in backward on the stack


def hold(replay: bool = False) -> "callable":
    """Keep every ZeRO-3 parameter gathered in backward (released by the optimizer step instead) until the
    returned callable runs: ``paddle.grad(..., create_graph=True)`` builds a graph of gradient nodes that read
    the parameters in a later backward, where no layer hook gathers them again. ``replay``: a recompute region's
    re-run, whose batch-norm statistics updates are not written to the chunks a second time."""
    _HOLDS[0] += 1
    _REPLAYS[0] += int(replay)
    done = []

    def end():
        if not done:
            done.append(True)
            _HOLDS[0] -= 1
            _REPLAYS[0] -= int(replay)
    return end


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
