"""``paddle.save`` and ``paddle.jit.save`` over a model (or a state dict) laid out by autoparallel.

paddle pickles a distributed parameter as the tensor it is: this rank's local shard. ``paddle.save(
model.state_dict(), p)`` of a tensor-parallel model wrote half of each sharded weight under the whole weight's
name; a plain model's ``set_state_dict`` then skipped those entries with a warning and kept its own initial
weights (wrong outputs); a ZeRO-3 parameter released between uses failed inside paddle. ``paddle.jit.save`` of a
distributed model failed while building the program (``Value Wrapper is only support None and pir.Value``).

Here:

* ``paddle.save(obj, path)``: every distributed tensor in ``obj`` (nested dicts, lists, tuples) that is whole on
  this rank (replicated on every mesh dim and holding its data: data parallel, ZeRO-1/2) is saved as its plain
  global value; one that is not (a shard, a partial sum, a released ZeRO-3 parameter) raises
  ``ShardedExportError`` naming the entry and the collective forms to use instead. Nothing is gathered
  behind the user's back: ``paddle.save`` is often called on one rank only, where a gather would hang. A file is
  written under a temporary name and renamed over ``path`` once complete (paddle overwrote it in place: a process
  killed mid-save lost the previous file).
* ``paddle.jit.save(layer, path, input_spec)`` (also a layer after ``paddle.jit.to_static``, and ``ap.to_static``'s
  ``DistModel``, saved as its network): a layer holding
  distributed parameters is exported as ``ap.full_model(layer)``, its plain one-process copy, when every
  parameter is whole on this rank; otherwise ``ShardedExportError`` says to call ``ap.full_model`` on every rank
  and save the plain copy.
"""
from __future__ import annotations

import os
import uuid

from autoparallel import patches

_INSTALLED = [False]

HOW = ("call `state = ap.full_state_dict(model)` (an optimizer's: `ap.full_state_dict(optimizer)`; or "
       "`plain = ap.full_model(model)`) on every rank (it gathers), "
       "then save that on one rank: `paddle.save(state, path)` / `paddle.jit.save(plain, path, input_spec=...)`; "
       "for a distributed checkpoint use ap.save_state_dict; to keep this rank's shard on purpose, save "
       "`ap.dtensor_to_local(tensor)`")


class ShardedExportError(NotImplementedError):
    """A save would need the global value of a tensor this rank holds only part of."""


def _describe(value) -> str:
    from autoparallel.placement import Replicate

    held = "" if any(not isinstance(p, Replicate) for p in value.placements) else \
        ", a ZeRO-3 parameter released between uses (its data lives in the optimizer's chunks)"
    return f"layout {[str(p) for p in value.placements]}, global shape {list(value.spec.shape)}{held}"


def plain_tree(obj, where: str = "obj"):
    """``obj`` with every distributed tensor replaced by its plain global value; ShardedExportError where that
    value is not on this rank."""
    from autoparallel.dist_tensor import is_dist
    from autoparallel.export_forms import not_whole, plain_value

    if is_dist(obj):
        if not_whole(obj):
            raise ShardedExportError(f"paddle.save: {where} is distributed ({_describe(obj)}) and this rank holds "
                                     f"only part of it: saving it would store a shard as the whole tensor; {HOW}")
        return plain_value(obj)
    if isinstance(obj, dict):
        return type(obj)((k, plain_tree(v, f"{where}[{k!r}]")) for k, v in obj.items()) \
            if type(obj) is not dict else {k: plain_tree(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(plain_tree(v, f"{where}[{i}]") for i, v in enumerate(obj))
    return obj


def _has_dist(obj) -> bool:
    from autoparallel.dist_tensor import is_dist

    if is_dist(obj):
        return True
    if isinstance(obj, dict):
        return any(_has_dist(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_dist(v) for v in obj)
    return False


def _save(orig):
    def save(obj, path, protocol=4, **configs):
        if _has_dist(obj):
            obj = plain_tree(obj, "the object")
        if not _replaceable_file(path):
            return orig(obj, path, protocol, **configs)
        return _save_replacing(orig, obj, os.fspath(path), protocol, configs)

    save._ap_wrapper = True
    save.__wrapped__ = orig
    return save


def _replaceable_file(path) -> bool:
    """A file path paddle would write (not a buffer, not a directory paddle refuses)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    path = os.fspath(path)
    return bool(os.path.basename(path)) and not os.path.isdir(path) and not os.path.islink(path)


def _save_replacing(orig, obj, path, protocol, configs):
    """paddle writes ``path`` in place: a process killed mid-write (or two ranks saving the same name) left a
    truncated file where the previous save was. Here paddle writes a temporary file next to it, which is synced
    and renamed over ``path``: the old file stays whole until the new one is complete."""
    from autoparallel.checkpoint.atomic import fsync_dir

    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        out = orig(obj, tmp, protocol, **configs)
        if os.path.isfile(tmp):
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(os.path.abspath(path)))
        return out
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def exportable(layer):
    """``layer`` itself, or its plain copy when it holds distributed parameters (ShardedExportError where a
    parameter is not whole on this rank)."""
    import paddle

    from autoparallel.export_forms import full_model, holds_dist, not_whole

    if not isinstance(layer, paddle.nn.Layer) or not holds_dist(layer):
        return layer
    parts = sorted(k for k, v in layer.state_dict().items() if not_whole(v))
    if parts:
        raise ShardedExportError(f"paddle.jit.save: {type(layer).__name__} holds distributed parameters this rank has "
                                 f"only part of ({', '.join(parts[:4])}{', ...' if len(parts) > 4 else ''}); the "
                                 f"exported program would compute with shards. Export the one-process model: "
                                 f"`plain = ap.full_model(model)` on every rank (it gathers), then "
                                 f"`paddle.jit.save(plain, path, input_spec=...)` on one rank")
    return full_model(layer)


def _jit_save(orig):
    def jit_save(layer, path, input_spec=None, **configs):
        from autoparallel.graph.jit import _ignore_own_modules

        target = _exportable_target(layer)
        _ignore_own_modules()       # the translator calls autoparallel's routing wrappers as they are
        return orig(target, path, input_spec, **configs)

    jit_save._ap_wrapper = True
    jit_save.__wrapped__ = orig
    return jit_save


def _exportable_target(layer):
    """A Layer, or a to_static function bound to a Layer (``paddle.jit.to_static(model.forward)``)."""
    from autoparallel.export_forms import _check_layer
    from autoparallel.parallel.pipeline.runtime import PipelineModule

    if isinstance(layer, PipelineModule):
        _check_layer(layer, "paddle.jit.save")
    from autoparallel.graph.to_static import DistModel

    if isinstance(layer, DistModel):           # paddle's DistModel is saved through its network
        layer = layer.network
    owner = getattr(layer, "_class_instance", None)
    if owner is not None and exportable(owner) is not owner:
        raise ShardedExportError("paddle.jit.save of a method of a distributed layer: export the plain copy, "
                                 "`paddle.jit.save(ap.full_model(model), path, input_spec=...)`")
    return exportable(layer)


def install() -> None:
    if _INSTALLED[0]:
        return
    import paddle
    import paddle.jit.api as jit_api

    if not getattr(paddle.save, "_ap_wrapper", False):
        patches.patch(paddle, "save", _save(paddle.save))
    orig = jit_api.save
    if not getattr(orig, "_ap_wrapper", False):
        wrapped = _jit_save(orig)
        patches.patch(jit_api, "save", wrapped)
        if paddle.jit.save is orig:
            patches.patch(paddle.jit, "save", wrapped)
    _INSTALLED[0] = True


def _reset() -> None:
    _INSTALLED[0] = False


patches.on_undo(_reset)
