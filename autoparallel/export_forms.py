"""A model laid out by autoparallel, taken out of training: its one-process state dict and a plain copy.

    state = ap.full_state_dict(model)     # {key: the global value as a plain tensor}; every rank calls it
    plain = ap.full_model(model)          # a plain copy of the same class: global weights, no layouts, no hooks
    paddle.jit.save(plain, path, input_spec=[InputSpec([None, 8], "float32")])     # on one rank
    paddle.save(state, path + ".pdparams")                                          # on one rank

Both read a sharded parameter's global value with a collective (a tensor-parallel shard is gathered, a ZeRO-3
parameter released between uses is gathered through its optimizer), visiting the parameters in one sorted order,
so every rank of the mesh calls them, as it calls a training step. The plain copy keeps the user's own forward
hooks and drops autoparallel's (input sharding, tensor-parallel relayouts, ZeRO-3 gathers, AMP casts) and the
forwards autoparallel swapped in (recompute): it computes what the one-process model computes, in plain
tensors, and the training model is left as it was.

``paddle.save`` and ``paddle.jit.save`` over a distributed model (export_save.py) use these where no collective
is needed (every parameter whole on this rank: data parallel, ZeRO-1/2) and refuse otherwise, naming them.
"""
from __future__ import annotations

import copy

import numpy as np

__all__ = ["full_state_dict", "full_model", "holds_dist", "not_whole"]

OURS = "autoparallel"


def holds_dist(model) -> bool:
    """Whether ``model`` (a paddle Layer) holds a distributed parameter or buffer."""
    from autoparallel.dist_tensor import is_dist

    return any(is_dist(v) for v in model.state_dict().values())


def not_whole(value) -> bool:
    """Whether reading ``value``'s global value on this rank needs a collective: a distributed tensor sharded or
    partial on some mesh dim, or a ZeRO-3 parameter released between uses."""
    from autoparallel.dist_tensor import DistParameter, is_dist
    from autoparallel.placement import Replicate

    if not is_dist(value):
        return False
    if any(not isinstance(p, Replicate) for p in value.placements):
        return True
    local = value if isinstance(value, DistParameter) else value.local
    released = hasattr(local, "_is_initialized") and not local._is_initialized()
    return released and int(np.prod(value.spec.shape, dtype=np.int64)) > 0


def plain_value(value):
    """The global value of a distributed tensor as a plain, detached tensor (collective when not whole);
    anything else as it is."""
    import paddle

    from autoparallel.dist_tensor import is_dist

    if not is_dist(value):
        return value
    with paddle.no_grad():
        full = value.full()
        data = full.numpy() if is_dist(full) else full.detach().numpy()
    return paddle.to_tensor(data, dtype=value.dtype, stop_gradient=True)


def full_state_dict(model) -> dict:
    """``model.state_dict()`` with every distributed entry as its global value (a plain tensor): what the
    one-process model's ``state_dict()`` holds. Collective on real ranks: every rank calls it. An optimizer's:
    its ``state_dict()`` as the one-process optimizer holds it (optimizer_state_forms.py)."""
    if callable(getattr(model, "step", None)) and callable(getattr(model, "state_dict", None)):
        return _full_tree(model.state_dict())
    _check_layer(model, "full_state_dict")
    state = model.state_dict()
    values = {}
    for key in sorted(state):                 # one order on every rank: the gathers pair up
        values[key] = plain_value(state[key])
    return {key: values[key] for key in state}


def _full_tree(obj):
    """Nested dicts with every distributed value gathered, in one sorted order on every rank."""
    if not isinstance(obj, dict):
        return plain_value(obj)
    done = {k: _full_tree(obj[k]) for k in sorted(obj, key=str)}
    return {k: done[k] for k in obj}


def full_model(model):
    """A plain copy of ``model``: same class and structure, every parameter and buffer its global value as a
    plain paddle Parameter / tensor, autoparallel's hooks and swapped forwards removed, ``training`` flags as
    they are. Collective on real ranks: every rank calls it. The original model is untouched."""
    _check_layer(model, "full_model")
    from autoparallel.layer_copy import plain_copies

    memo = _plain_memo(model)
    with plain_copies():
        plain = copy.deepcopy(model, memo)
    for _, sub in plain.named_sublayers(include_self=True):
        _strip(sub)
    return plain


def _check_layer(model, where: str) -> None:
    import paddle

    from autoparallel.parallel.pipeline.runtime import PipelineModule

    if isinstance(model, PipelineModule):
        raise NotImplementedError(f"{where}: a pipeline-parallel model (PipelineModule) keeps its stages on different "
                                  f"ranks and is not gathered into one plain model here; build the model without "
                                  f"pipeline_parallel for export, or save it with ap.save_state_dict")
    if not isinstance(model, paddle.nn.Layer):
        raise TypeError(f"{where} expects a paddle.nn.Layer, got {type(model).__name__}")


def _plain_memo(model) -> dict:
    """deepcopy's memo: each distributed parameter (tied ones once) -> a plain Parameter of its global value;
    each distributed buffer -> its global value."""
    from autoparallel.dist_tensor import DistParameter, is_dist

    tensors = {}
    for sub_name, sub in sorted(model.named_sublayers(include_self=True), key=lambda kv: kv[0]):
        for table in (sub._parameters, sub._buffers):
            for name in sorted(table):
                v = table[name]
                if v is not None and is_dist(v) and id(v) not in tensors:
                    tensors[id(v)] = v
    memo = {}
    for key, v in tensors.items():          # insertion order: sorted by (layer, name) above, same on every rank
        memo[key] = plain_param(v) if isinstance(v, DistParameter) else plain_value(v)
    return memo


def plain_param(p):
    from autoparallel.compat import EagerParamBase

    value = plain_value(p)
    new = EagerParamBase(shape=list(value.shape), dtype=value.dtype, trainable=getattr(p, "trainable", True))
    new.set_value(value)
    new.stop_gradient = p.stop_gradient
    for attr in ("optimize_attr", "regularizer", "do_model_average", "need_clip", "is_distributed"):
        if hasattr(p, attr):
            try:
                setattr(new, attr, getattr(p, attr))
            except (AttributeError, TypeError, ValueError):
                pass
    return new


def _ours(fn) -> bool:
    fn = getattr(fn, "func", fn)                        # functools.partial
    fn = getattr(fn, "__func__", fn)                    # bound method
    return (getattr(fn, "__module__", None) or "").split(".")[0] == OURS


def _strip(sub) -> None:
    """Drop autoparallel's forward hooks and the forwards it assigned on the instance (recompute wrappers)."""
    for table in (sub._forward_pre_hooks, sub._forward_post_hooks):
        for hook_id in [k for k, fn in table.items() if _ours(fn)]:
            del table[hook_id]
            for extra in ("_forward_pre_hooks_with_kwargs_flag", "_forward_post_hooks_with_kwargs_flag"):
                flags = getattr(sub, extra, None)
                if isinstance(flags, dict):
                    flags.pop(hook_id, None)
    fwd = sub.__dict__.get("forward")
    if fwd is not None and _ours(fwd):
        del sub.__dict__["forward"]
