"""``Layer.set_state_dict`` (also ``set_dict`` / ``load_dict``) on a model with distributed parameters.

paddle matches each value's shape against ``param.shape``, which for a distributed parameter is its local
shard: a single-process state dict (global shapes) was skipped with a warning and the model kept its
weights. Here a distributed parameter takes its entry as paddle does for a distributed tensor: a value of the
global shape is laid out (``set_value``), a value of the shard's shape sets the shard (one shard held), a
distributed value is resharded to the parameter's layout; any other shape raises ValueError. Everything
else goes through paddle's own ``set_state_dict``."""
from __future__ import annotations

import warnings

import numpy as np

from autoparallel import patches
from autoparallel.dist_tensor import as_dist, is_dist, reshard
from autoparallel.local_mode import local_mode


def install() -> None:
    import paddle

    Layer = paddle.nn.Layer
    orig = Layer.set_state_dict
    if getattr(orig, "_ap_wrapper", False):
        return

    def set_state_dict(self, state_dict, use_structured_name=True):
        ours = {}
        for key, p in self._state_dict_impl(use_hook=False).items():
            name = key if use_structured_name else p.name
            if is_dist(p) and hasattr(p, "_ap_spec") and name in state_dict:
                ours[name] = p
        state_dict = _plain_sources(state_dict, ours)
        for name, p in ours.items():             # every entry checked before anything is written
            _check_shape(name, p, state_dict[name])
        if not ours:
            return orig(self, state_dict, use_structured_name)
        rest = {k: v for k, v in state_dict.items() if k not in ours}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            missing, unexpected = orig(self, rest, use_structured_name)
        for w in caught:                      # paddle's "not found" for the entries set here: not missing
            if not any(f"{k} is not found" in str(w.message) for k in ours):
                warnings.warn(w.message, w.category)
        for name, p in ours.items():
            _load(name, p, state_dict[name])
        return [k for k in missing if k not in ours], unexpected

    set_state_dict._ap_wrapper = True
    set_state_dict.__wrapped__ = orig
    for attr in ("set_state_dict", "set_dict", "load_dict"):
        if getattr(Layer, attr, None) is orig:
            patches.patch(Layer, attr, set_state_dict)


def _plain_sources(state_dict, ours: dict):
    """Distributed values bound for plain tensors as their global values (paddle would compare the local shard's
    shape, skip the entry with a warning and keep the old weight); a value this rank holds only part of raises."""
    from autoparallel.export_forms import not_whole, plain_value
    from autoparallel.export_save import HOW, ShardedExportError

    moved = {k: v for k, v in state_dict.items() if k not in ours and is_dist(v)}
    if not moved:
        return state_dict
    part = sorted(k for k, v in moved.items() if not_whole(v))
    if part:
        raise ShardedExportError(f"set_state_dict: {', '.join(part[:4])} are distributed values this rank holds only "
                                 f"part of, bound for plain (one-process) tensors; {HOW}")
    return {k: (plain_value(v) if k in moved else v) for k, v in state_dict.items()}


def _check_shape(name, p, value) -> None:
    """Every entry as ``_load`` will write it, before any is written (a failure in ``_load`` left the entries paddle
    had set and the ones before it loaded): a plain value takes the parameter's global shape, or its shard's where
    this process holds one shard (a real rank; the simulated world holds every rank's), in the parameter's dtype
    (as paddle's own ``set_state_dict`` asserts); a distributed value its global shape (it is resharded)."""
    import paddle

    from autoparallel.spec import normalize_dtype

    if is_dist(value):
        shape = list(as_dist(value).spec.shape)
        if shape != list(p.global_shape):
            raise ValueError(f"set_state_dict: {name} is a distributed value of global shape {shape}; the "
                             f"distributed parameter's global shape is {p.global_shape}; nothing was loaded")
        _check_dtype(name, p, as_dist(value).spec.dtype)
        return
    shape = list(value.shape() if callable(getattr(value, "shape", None)) else np.shape(value))
    shard = list(p.shape) if len(getattr(p, "_ap_locals", None) or {0: p}) == 1 else None
    if shape not in (p.global_shape, shard):
        held = "" if shard is not None else (f" (this process holds the shards of ranks {sorted(p._ap_locals)}, the "
                                             f"simulated world: a shard's shape names none of them)")
        raise ValueError(f"set_state_dict: {name} has shape {shape}; the distributed parameter takes its global "
                         f"shape {p.global_shape}" + (f" (or its shard's, {shard})" if shard is not None else held)
                         + "; nothing was loaded")
    if isinstance(value, (np.ndarray, paddle.Tensor)):
        _check_dtype(name, p, "bfloat16" if value.dtype == np.uint16 else normalize_dtype(value.dtype))


def _check_dtype(name, p, dtype: str) -> None:
    """A value of another dtype is refused, as paddle's ``set_value`` refuses it (a uint16 array is paddle's
    bfloat16 numpy form); a distributed one was cast silently (float32 into a float16 model)."""
    if dtype != p.spec.dtype:
        raise TypeError(f"set_state_dict: {name} is {dtype}; the distributed parameter is {p.spec.dtype} (cast the "
                        f"value first, as paddle requires); nothing was loaded")


def _load(name, p, value) -> None:
    import paddle

    if is_dist(value):
        from autoparallel.dist_tensor_forms import _writing, gather_released

        if hasattr(value, "_ap_locals"):        # a released ZeRO-3 parameter of another model (an EMA copy's source)
            gather_released(value)
        src = reshard(as_dist(value), p.mesh, p.placements)
        # as set_value: a released ZeRO-3 target is gathered for the write, and a ZeRO target's fp32 master chunks
        # take the value (the next step would write the old masters back over the loaded shards)
        with _writing(p), local_mode(), paddle.no_grad():
            for r, t in p.locals.items():
                t.set_value(src.local_of(r).astype(t.dtype))
        return
    with paddle.no_grad():
        p.set_value(value if isinstance(value, (np.ndarray, paddle.Tensor)) else np.asarray(value))
