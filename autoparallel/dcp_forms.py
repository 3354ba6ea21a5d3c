"""paddle's distributed checkpoint calls, ``paddle.distributed.save_state_dict(state, path)`` /
``load_state_dict(state, path)``, over state dicts holding autoparallel's distributed tensors.

paddle's writer knows its own ``DistTensor`` only: a parameter laid out here went through ``paddle.save`` (a
shard refused, after paddle had written the metadata of a checkpoint without data) and an optimizer state failed
with ``The value should be dict or paddle.Tensor``; a plain tensor holding a shard would be written as the whole.
Here such a state dict is saved and loaded by autoparallel's checkpoint (``ap.save_state_dict`` /
``ap.load_state_dict``: every rank writes its shards, a load reshards to the live layout, so the checkpoint loads
into another mesh or one process). ``async_save`` runs synchronously; options with no equivalent (a process group,
safetensors, replicas, ``aoa_config``, offload, worker groups, another comm method) raise NotImplementedError.
A checkpoint written that way loads through ``ap.load_state_dict`` into any state dict (a plain one too), and
``paddle.distributed.load_merged_state_dict(path)`` reads it whole (``ap.load_merged_state_dict``); a state
dict without distributed tensors, saved or loaded with paddle's own checkpoints, goes to paddle unchanged.
"""
from __future__ import annotations

from autoparallel import patches

_SAVE_DEFAULTS = {"process_group": None, "unique_id": None, "safetensors": False, "save_replicas": False}
_LOAD_DEFAULTS = {"process_group": None, "unique_id": None, "offload": False, "aoa_config": None,
                  "safetensors": False, "worker_groups": None, "comm_method": "broadcast"}
_IGNORED = {"coordinator_rank": "which rank writes the metadata", "async_save": "run synchronously",
            "mw_name_compatibility": "master-weight names kept as given"}


def _check(fn: str, given: dict, defaults: dict) -> None:
    for k, v in given.items():
        if k in _IGNORED:
            continue
        if k not in defaults:
            raise TypeError(f"paddle.distributed.{fn}() got an unexpected keyword argument {k!r}")
        if v != defaults[k]:
            raise NotImplementedError(
                f"paddle.distributed.{fn}({k}={v!r}) over autoparallel's distributed tensors: the state is written "
                f"by autoparallel's checkpoint (ap.{fn}), which has no such option; leave {k} at its default "
                f"({defaults[k]!r})")


def _save(orig):
    def save_state_dict(state_dict, path, *args, **kwargs):
        from autoparallel.export_save import _has_dist

        if not _has_dist(state_dict):
            return orig(state_dict, path, *args, **kwargs)
        names = ["process_group", "coordinator_rank", "unique_id", "async_save", "safetensors", "save_replicas"]
        kwargs.update(zip(names, args))
        _check("save_state_dict", kwargs, _SAVE_DEFAULTS)
        from autoparallel.checkpoint.save import save_state_dict as ap_save

        ap_save(state_dict, path, overwrite=_ours(path))
        return None

    save_state_dict._ap_wrapper = True
    save_state_dict.__wrapped__ = orig
    return save_state_dict


def _ours(path) -> bool:
    """Whether ``path`` is a checkpoint an earlier call wrote (paddle's save writes into an existing directory;
    autoparallel replaces only its own checkpoints, anything else is refused by ap.save_state_dict)."""
    import os

    return os.path.isdir(path) and bool(os.listdir(path))


def _load(orig):
    def load_state_dict(state_dict, path, *args, **kwargs):
        import os

        from autoparallel.checkpoint.ownership import CKPT_MARKER
        from autoparallel.export_save import _has_dist

        if not _has_dist(state_dict) and not os.path.exists(os.path.join(str(path), CKPT_MARKER)):
            return orig(state_dict, path, *args, **kwargs)
        names = ["process_group", "coordinator_rank", "unique_id", "offload", "mw_name_compatibility",
                 "aoa_config", "safetensors", "worker_groups", "comm_method"]
        kwargs.update(zip(names, args))
        _check("load_state_dict", kwargs, _LOAD_DEFAULTS)
        from autoparallel.checkpoint.load import load_state_dict as ap_load

        ap_load(state_dict, path, strict=False)
        return None

    load_state_dict._ap_wrapper = True
    load_state_dict.__wrapped__ = orig
    return load_state_dict


def _merged(orig):
    def load_merged_state_dict(path, *args, **kwargs):
        import os

        from autoparallel.checkpoint.ownership import CKPT_MARKER

        if not os.path.exists(os.path.join(str(path), CKPT_MARKER)):
            return orig(path, *args, **kwargs)
        kwargs.update(zip(["prefix", "unique_id", "offload", "aoa_config", "safetensors"], args))
        prefix, offload = kwargs.pop("prefix", None), kwargs.pop("offload", False)
        _check("load_merged_state_dict", kwargs, {"unique_id": None, "aoa_config": None, "safetensors": False})
        return merged_as_paddle(path, prefix, offload)

    load_merged_state_dict._ap_wrapper = True
    load_merged_state_dict.__wrapped__ = orig
    return load_merged_state_dict


def merged_as_paddle(path, prefix=None, offload=False) -> dict:
    """``ap.load_merged_state_dict(path)`` in the form of paddle's ``load_merged_state_dict``: one flat dict, the
    keys of nested dicts joined with ".", tensors as paddle Tensors; ``prefix`` keeps the keys starting with it and
    strips it and the character after it, as paddle does. (It was the nested dict of numpy arrays: a nested
    state's entries were not Tensors and not under paddle's keys.)"""
    import paddle

    from autoparallel.checkpoint.flatten import SEP
    from autoparallel.checkpoint.load import load_merged_state_dict as ap_merged

    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(f"load_merged_state_dict: prefix must be a str or None, got {type(prefix).__name__}")
    out = {}
    for name, v in ap_merged(path, flat=True).items():
        key = name.replace(SEP, ".")
        if key in out:
            raise ValueError(f"load_merged_state_dict: the checkpoint's entries {key!r} and {name!r} take the same "
                             f"flat key {key!r}; load it with ap.load_merged_state_dict(path) (nested)")
        if prefix is not None and not key.startswith(prefix):
            continue
        if hasattr(v, "dtype"):
            v = paddle.to_tensor(v, place=paddle.CPUPlace()) if offload else paddle.to_tensor(v)
        out[key[len(prefix) + 1:] if prefix else key] = v
    return out


def install() -> None:
    import paddle.distributed as dist
    from paddle.distributed.flex_checkpoint import dcp

    for mod, name, make in ((dist, "save_state_dict", _save), (dist, "load_state_dict", _load),
                            (dist, "load_merged_state_dict", _merged)):
        orig = getattr(mod, name)
        if getattr(orig, "_ap_wrapper", False):
            continue
        wrapped = make(orig)
        patches.patch(mod, name, wrapped)
        if getattr(dcp, name, None) is orig:
            patches.patch(dcp, name, wrapped)
