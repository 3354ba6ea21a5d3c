"""``Layer.to(dtype=...)``, ``Layer.bfloat16()``, ``Layer.float16()``, ``Layer.float()`` on a layer whose parameters
are already distributed: paddle's ``Layer._transform`` casts a tensor and shares the result into its storage, which a
distributed parameter (one local tensor per rank it holds) does not have. Patched (once, by ``install``): a
distributed tensor is cast local by local, each through paddle's own ``_transform``, and its DistSpec takes the new
dtype; every other tensor runs paddle's code unchanged. Casting before or after ``shard_layer``/``parallelize`` then
gives the same parameters.

``paddle.amp.decorate(..., save_dtype=...)`` registers a state-dict hook casting every floating value (and naming
the copy after it: a distributed tensor has no name slot); patched likewise, a distributed value is cast rank by rank
into a distributed tensor of ``save_dtype``. ``decorate(optimizers=...)`` given an optimizer already sharded
(``shard_optimizer`` / ``ap.parallelize``) raises TypeError saying to decorate first (paddle's own check rejects
such a wrapper on a GPU with a message naming neither; on a CPU decorate returns before checking)."""
from __future__ import annotations

import dataclasses
import weakref

_installed = False
_COPIES: dict = {}          # id(save_dtype copy) -> (weak reference to the copy, the tensor it was cast from)


def install() -> None:
    global _installed
    if _installed:
        return
    from autoparallel import compat, patches

    owner, name = compat.layer_cast_slot()
    base = getattr(owner, name)

    def _transform(self, t, device, dtype, blocking):
        from autoparallel.dist_tensor import is_dist

        if not is_dist(t):
            return base(self, t, device, dtype, blocking)
        return cast_dist(t, dtype, lambda x: base(self, x, device, dtype, blocking))

    patches.patch(owner, name, _transform)      # undone by ap.uninstall()
    _install_save_dtype(patches)
    _install_decorate_check(patches)
    patches.on_undo(_reset)
    _installed = True


def _reset() -> None:
    global _installed
    _installed = False


def cast_dist(t, dtype, cast_local):
    """Every local of the distributed tensor ``t`` cast in place by ``cast_local``; ``t``'s spec takes ``dtype``."""
    from autoparallel.dist_tensor import DistTensor
    from autoparallel.local_mode import local_mode
    from autoparallel.spec import normalize_dtype

    with local_mode():
        for x in t.locals.values():
            cast_local(x)
        new = normalize_dtype(str(next(iter(t.locals.values())).dtype).replace("paddle.", "")) if dtype is None \
            else normalize_dtype(dtype)
    spec = dataclasses.replace(t.spec, dtype=new)
    if isinstance(t, DistTensor):
        t._spec = spec
    else:
        t._ap_spec = spec
    return t


def _install_save_dtype(patches) -> None:
    import importlib

    hook = importlib.import_module("paddle.amp.auto_cast").StateDictHook
    base = hook.__call__

    def __call__(self, state_dict):
        from autoparallel.dist_tensor import is_dist

        sources = dict(state_dict)
        spread = [k for k, v in state_dict.items() if is_dist(v)]
        rest = {k: v for k, v in state_dict.items() if k not in spread}
        base(self, rest)
        for k, src in sources.items():
            state_dict[k] = rest[k] if k in rest else _cast_value(src, self._save_dtype)
            if state_dict[k] is not src:
                _remember(state_dict[k], src)
        return None

    patches.patch(hook, "__call__", __call__)


def _remember(copy, src) -> None:
    """Keyed by identity (tensors compare elementwise), forgotten when the copy is collected."""
    ref, origin = _COPIES.get(id(src), (None, None))
    if ref is not None and ref() is src:        # a parent layer's hook casts its children's copies again
        src = origin
    key = id(copy)
    _COPIES[key] = (weakref.ref(copy, lambda _r: _COPIES.pop(key, None)), src)


def _cast_value(v, dtype):
    """A distributed floating value as a new distributed tensor of ``dtype`` (others as they are)."""
    import paddle

    if not paddle.is_floating_point(v):
        return v
    with paddle.no_grad():
        return v.astype(dtype)


def write_back(state) -> None:
    """After a checkpoint was loaded into ``state``: every ``save_dtype`` copy in it (``model.state_dict()`` of a
    decorated model holds copies, not the parameters) written into the tensor it was cast from, in that tensor's
    dtype; without this the load would fill the copies and leave the model as it was."""
    import paddle

    from autoparallel.dist_tensor import is_dist
    from autoparallel.local_mode import local_mode

    values = state.values() if isinstance(state, dict) else []
    for v in values:
        if isinstance(v, dict):
            write_back(v)
            continue
        ref, src = _COPIES.get(id(v), (None, None))
        if ref is None or ref() is not v:
            continue
        with local_mode(), paddle.no_grad():
            pairs = [(src.locals[r], v.locals[r]) for r in src.locals] if is_dist(src) else [(src, v)]
            for dst, got in pairs:
                dst.set_value(got.astype(dst.dtype))


def _install_decorate_check(patches) -> None:
    import importlib

    import paddle

    module = importlib.import_module("paddle.amp.auto_cast")
    base = module.decorate

    def decorate(models, optimizers=None, *args, **kwargs):
        check_not_sharded(optimizers)
        return base(models, optimizers, *args, **kwargs)

    decorate.__doc__, decorate.__wrapped__ = base.__doc__, base
    for owner in (paddle.amp, module):
        patches.patch(owner, "decorate", decorate)


def check_not_sharded(optimizers) -> None:
    """TypeError when ``optimizers`` (one or a list) holds an optimizer already sharded by ap."""
    from autoparallel.parallel.step_hooks import StepHooks

    for opt in optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]:
        if isinstance(opt, StepHooks):
            raise TypeError(f"paddle.amp.decorate(optimizers=...) got a {type(opt).__name__}, an optimizer already "
                            f"sharded (dist.shard_optimizer / ap.parallelize): its master weights and states are "
                            f"laid out for the parameters' current dtype. Decorate the model and the paddle "
                            f"optimizer first, then shard them: model, opt = paddle.amp.decorate(model, opt, "
                            f"level='O2'); opt = dist.shard_optimizer(opt, ...)")
