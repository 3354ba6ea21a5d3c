"""``copy.deepcopy`` of a distributed parameter or of a parallelized model (an EMA copy, a frozen reference
model): a working copy with the same layouts and storage of its own, or a typed error -- never two models
sharing storage or rewrites.

    ema = copy.deepcopy(model)          # after ap.parallelize: every parameter a DistParameter on the same mesh
                                        # and placements, every rank's shard cloned; input sharding carried over

paddle copies a Parameter as a plain Parameter of its local data, which would turn a shard into a wrong-sized
plain weight; a DistParameter copies all its held shards instead (``copy_param``). A ZeRO-3 parameter (released
between uses) is gathered for the copy, which holds it whole and is not sharded by any optimizer; the copy's
layers drop the ZeRO-3 gather/release hooks (bound to the original's optimizer and parameters). A layer keeps
what autoparallel knows about it (its mesh) on the copy, so the copy shards its inputs and refuses a second
``ap.parallelize`` like the original. Refused, naming what to do instead: a layer whose ``forward``
autoparallel rewrote in place (recompute segments: the rewrite calls the original layer).
"""
from __future__ import annotations

import contextlib
import copy

import paddle

from autoparallel import layer_state, patches

_PLAIN = [0]            # inside plain_copies(): the copy becomes a plain model (export_forms.full_model)
_BOUND_TO_ORIGINAL = ("autoparallel.parallel.zero_params",)   # hooks closed over the original's parameters
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_post_hooks", "_forward_pre_hooks_with_kwargs_flag",
               "_forward_post_hooks_with_kwargs_flag", "_forward_post_hooks_always_called")


def copy_param(param, memo):
    """A DistParameter with the same spec and every held shard cloned (paddle's own naming: ``<name>_deepcopy_k``)."""
    from autoparallel.dist_tensor import _make_param
    from autoparallel.dist_tensor_forms import _whole
    from autoparallel.local_mode import local_mode

    with _whole(param), local_mode(), paddle.no_grad():      # a released ZeRO-3 parameter: gathered for the copy
        held = {r: t.detach().clone() for r, t in param._ap_locals.items()}
    new = _make_param(held, param._ap_spec, like=param)
    new.name = param.name + paddle.utils.unique_name.generate("_deepcopy")
    for key, value in param.__dict__.items():           # marks of our own (partial dims of sequence-parallel norms)
        if key.startswith("_ap_") and key != "_ap_spec":
            setattr(new, key, copy.deepcopy(value, memo))
    memo[id(param)] = new
    return new


@contextlib.contextmanager
def plain_copies():
    """Layers deep-copied here become plain models: no mesh carried over, rewrites allowed (the caller strips
    them and maps every distributed parameter to a plain one in the memo)."""
    _PLAIN[0] += 1
    try:
        yield
    finally:
        _PLAIN[0] -= 1


def layer_deepcopy(self, memo):
    """What ``copy.deepcopy`` does for a Layer (``__getstate__`` / ``__setstate__``), then autoparallel's
    knowledge of the original carried over (or refused, see the module docstring)."""
    if not _PLAIN[0]:
        _check_rewrites(self)
    cls = type(self)
    new = cls.__new__(cls)
    memo[id(self)] = new
    new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
    _drop_bound_hooks(new)
    mesh = None if _PLAIN[0] else layer_state.mesh_of(self)
    if mesh is not None:
        layer_state.put(new, "mesh", mesh)
    return new


def _drop_bound_hooks(layer) -> None:
    """The copy's forward hooks that act on the original's parameters (ZeRO-3 gather/release) are removed."""
    hooks = {**layer.__dict__.get("_forward_pre_hooks", {}), **layer.__dict__.get("_forward_post_hooks", {})}
    bound = [k for k, fn in hooks.items() if getattr(fn, "__module__", None) in _BOUND_TO_ORIGINAL]
    for name in _HOOK_DICTS:
        table = layer.__dict__.get(name)
        for k in bound:
            if table is not None and k in table:
                del table[k]


def _check_rewrites(layer) -> None:
    """A forward set on the instance (recompute segments, selective recompute) is a closure over the original
    layer: the copy would run the original's weights. Refused on distributed layers."""
    if "forward" not in layer.__dict__:
        return
    from autoparallel.dist_tensor import is_dist

    if any(is_dist(p) for p in layer.parameters()):
        raise NotImplementedError(f"copy.deepcopy of a parallelized {type(layer).__name__} whose forward was "
                                  f"rewritten on the instance (strategy.recompute / ap.recompute_layers: the rewrite "
                                  f"calls the original layer, so the copy would run the original's weights); "
                                  f"deepcopy the model before ap.parallelize and parallelize the copy, or build the "
                                  f"copy with recompute off")


def install() -> None:
    from autoparallel.dist_tensor import DistParameter

    DistParameter.__deepcopy__ = copy_param          # our own class (paddle's would copy the local shard only)
    if "__deepcopy__" not in paddle.nn.Layer.__dict__:
        patches.patch(paddle.nn.Layer, "__deepcopy__", layer_deepcopy)
