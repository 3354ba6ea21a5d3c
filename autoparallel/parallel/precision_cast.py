"""``Layer.to(dtype=...)``, ``Layer.bfloat16()``, ``Layer.float16()``, ``Layer.float()`` on a layer whose parameters
are already distributed: paddle's ``Layer._transform`` casts a tensor and shares the result into its storage, which a
distributed parameter (one local tensor per rank it holds) does not have. Patched (once, by ``install``): a
distributed tensor is cast local by local, each through paddle's own ``_transform``, and its DistSpec takes the new
dtype; every other tensor runs paddle's code unchanged. Casting before or after ``shard_layer``/``parallelize`` then
gives the same parameters."""
from __future__ import annotations

import dataclasses

_installed = False


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
