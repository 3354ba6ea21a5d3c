"""PaddleFormers' ``Trainer`` checkpoints over a model distributed here: which forms are honoured, and the resume.

The Trainer's flex checkpoint (its default ``save_checkpoint_format``) written over a distributed model is one
process's (trainer_ranks.py: global parameters, whole optimizer states under ``{struct_name}.{state}``), under
TP, ZeRO 1/2/3 and their mixes alike. ``resume_from_checkpoint`` reads it back here instead of paddle's
``_load_flex_checkpoint`` (which asks fleet for its hybrid groups and loads into the optimizer's per-parameter
accumulators, which ZeRO keeps as chunks): every parameter takes its global value (``set_value``: each held shard
its part, ZeRO's master chunks with it), then the optimizer ``set_state_dict`` of one process's state dict (the
ZeRO optimizer cuts whole values into its chunks, whatever layout wrote them), then the Trainer's scheduler.
So a save under one layout resumes under another (ZeRO-2 -> ZeRO-3, -> plain DP) and in one process.

Refused before training (NotImplementedError naming the option), as nothing else writes or reads one process's
checkpoint over a distributed model: another ``save_checkpoint_format`` with ``save_strategy`` other than
``"no"`` (``None`` / ``"sharding_io"``: ``paddle.save(optimizer.state_dict())`` on the saving rank only, which
would hold distributed values -- a collective on one rank under ZeRO; ``"unified_checkpoint"``), another
``load_checkpoint_format``, and the flex options this load does not read (``load_from_hf``,
``sharded_model_from_ema``, ``aoa_config``, zero-cost checkpoints and their EMA, ``tensorwise_offload_optimizer``),
and saving over float16 / bfloat16 parameters of a ``multi_precision`` optimizer (its master weights).
"""
from __future__ import annotations

import os

import numpy as np

FLEX = "flex_checkpoint"
MODEL_DIR, OPT_DIR = "model_state", "optimizer_state"


def _value(x):
    return getattr(x, "value", x)


def refuse_forms(targs, who: str) -> None:
    """The checkpoint options a Trainer over a distributed model cannot honour, refused when it is built."""
    bad = []
    save = _value(getattr(targs, "save_strategy", "no"))
    saving = save != "no" and not getattr(targs, "ignore_save_lr_and_optim", False)
    fmt = getattr(targs, "save_checkpoint_format", FLEX)
    if saving and fmt != FLEX:
        bad.append(f"save_checkpoint_format={fmt!r} with save_strategy={save!r}")
    lfmt = getattr(targs, "load_checkpoint_format", FLEX)
    if lfmt != FLEX:
        bad.append(f"load_checkpoint_format={lfmt!r}")
    for opt in ("load_from_hf", "sharded_model_from_ema", "enable_zero_cost_checkpoint",
                "tensorwise_offload_optimizer"):
        if getattr(targs, opt, False):
            bad.append(f"{opt}=True")
    for opt in ("aoa_config", "zcc_save_ema_coef"):
        if getattr(targs, opt, None) is not None:
            bad.append(f"{opt}={getattr(targs, opt)!r}")
    if bad:
        raise NotImplementedError(
            f"{who} over a model distributed by autoparallel writes and reads its checkpoints as one process's "
            f"flex checkpoint (global parameters, whole optimizer states); got {', '.join(bad)}. Pass "
            f"save_checkpoint_format=\"{FLEX}\" / load_checkpoint_format=\"{FLEX}\" (the defaults) with these "
            f"options unset, or save_strategy=\"no\"")


def refuse_masters(model, optimizer, targs, who: str) -> None:
    """A ``multi_precision`` optimizer over float16 / bfloat16 parameters keeps fp32 master weights, which the
    one-process flex checkpoint written here does not hold (whole_state.py refused them at the first save):
    refused when the Trainer is built."""
    from autoparallel.parallel.precision_masters import keeps_masters

    save = _value(getattr(targs, "save_strategy", "no"))
    if save == "no" or getattr(targs, "ignore_save_lr_and_optim", False) or not keeps_masters(optimizer):
        return
    low = sorted({str(p.dtype).replace("paddle.", "") for p in model.parameters()
                  if not p.stop_gradient and str(p.dtype).endswith(("float16", "bfloat16"))})
    if low:
        raise NotImplementedError(
            f"{who} with save_strategy={save!r} over a model distributed by autoparallel with {'/'.join(low)} "
            f"parameters and a multi_precision optimizer: its checkpoints would lack the optimizer's fp32 master "
            f"weights. Use Strategy.amp (float32 parameters, no master weights in the optimizer), or "
            f"save_strategy=\"no\"")


def load(model, optimizer, path: str, with_optimizer: bool = True) -> None:
    """The flex checkpoint at ``path`` into ``model`` (global values laid out) and ``optimizer`` (one process's
    state dict). Everything is read and checked before anything is written. Every rank calls it."""
    params = _read(os.path.join(path, MODEL_DIR))
    live = model.state_dict()
    missing = sorted(k for k in live if k not in params)
    if missing:
        raise ValueError(f"resume_from_checkpoint={path!r}: the checkpoint's {MODEL_DIR} lacks {len(missing)} entries "
                         f"of {type(model).__name__} ({', '.join(missing[:4])})")
    for k, p in live.items():
        want = list(getattr(p, "global_shape", p.shape))
        if list(params[k].shape) != want:
            raise ValueError(f"resume_from_checkpoint={path!r}: {k} has shape {list(params[k].shape)} in the "
                             f"checkpoint; {type(model).__name__} expects {want}")
    state = _optimizer_state(live, _read(os.path.join(path, OPT_DIR)), path) if with_optimizer else None
    _assign(live, params)
    if state is not None:
        optimizer.set_state_dict(state)


def _read(path: str) -> dict:
    """The checkpoint directory ``path`` (paddle's ``save_state_dict`` format) as whole numpy arrays, read by this
    process from the files (paddle's loader, ``load_merged_state_dict``, reshards through ``.cuda()`` on several
    ranks: ValueError "No available device found" on CPUs)."""
    import paddle

    if not os.path.isdir(path):
        raise FileNotFoundError(f"resume_from_checkpoint: no {os.path.basename(path)} directory at {path}")
    metas = sorted(f for f in os.listdir(path) if f.endswith(".metadata"))
    if len(metas) != 1:
        raise ValueError(f"resume_from_checkpoint: {path} holds {len(metas)} .metadata files; expected one "
                         f"(the flex checkpoint of one save)")
    meta = paddle.load(os.path.join(path, metas[0]))
    files, out, seen = {}, {}, {}
    for key, pieces in meta.state_dict_metadata.items():
        shape = tuple(pieces[0].global_shape)
        out[key] = np.zeros(shape, dtype=_np_dtype(pieces[0].dtype))
        seen[key] = {}
    for index, name in meta.storage_metadata.items():
        if index.is_flattened:
            raise NotImplementedError(f"resume_from_checkpoint: {index.tensor_key} in {path} is stored flattened "
                                      f"(paddle's sharding stage 1 v2 layout); expected whole or block pieces")
        if name not in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise FileNotFoundError(f"resume_from_checkpoint: {path} lacks {name}, which its metadata names "
                                        f"(for {index.tensor_key}): an incomplete checkpoint")
            files[name] = paddle.load(os.path.join(path, name), return_numpy=True)
        piece = np.asarray(files[name][index.tensor_key])
        at = tuple(slice(o, o + n) for o, n in zip(index.global_offset, piece.shape))
        out[index.tensor_key][at] = piece
        seen[index.tensor_key][tuple(index.global_offset)] = piece.size      # a replica counts once
    short = [k for k, v in out.items() if sum(seen[k].values()) != v.size]
    if short:
        raise ValueError(f"resume_from_checkpoint: {path} does not hold every element of {len(short)} entries "
                         f"({', '.join(short[:4])}): an incomplete checkpoint")
    return out


def _np_dtype(name: str):
    if "bfloat16" in str(name):
        raise NotImplementedError("resume_from_checkpoint: a bfloat16 entry in a flex checkpoint (read as float32 "
                                  "is not exact here); train with Strategy.amp, whose parameters stay float32")
    return np.dtype(str(name).replace("paddle.", ""))


def _optimizer_state(live: dict, saved: dict, path: str) -> dict:
    """``{struct_name}.{state}`` entries as one process's ``optimizer.state_dict()`` (``{param.name}_{state}``)
    of this model (the parameter names of this process, which may differ from the saving one's)."""
    structs = sorted(live, key=len, reverse=True)
    out = {}
    for key, v in saved.items():
        s = next((s for s in structs if key.startswith(s + ".")), None)
        if s is None:
            raise ValueError(f"resume_from_checkpoint={path!r}: optimizer state {key!r} names no parameter of the "
                             f"model")
        out[f"{live[s].name}_{key[len(s) + 1:]}"] = v
    return out


def _assign(live: dict, params: dict) -> None:
    import paddle

    from autoparallel.dist_tensor import is_dist

    with paddle.no_grad():
        for k, p in live.items():
            v = params[k]
            t = paddle.to_tensor(v).astype(p.dtype)
            if is_dist(p):
                p.set_value(t)
            else:
                paddle.assign(t, output=p)
