"""Sort the leaves of a state into tensor records, JSON values and the shards each rank writes."""
from __future__ import annotations

import json

import numpy as np

from autoparallel.checkpoint.layout import owned_pieces
from autoparallel.checkpoint.leaves import HeldElsewhere, ShardedLeaf


def mesh_json(mesh) -> dict:
    return {"shape": mesh.shape, "process_ids": mesh.process_ids, "dim_names": mesh.dim_names}


def json_value(name: str, value):
    """``value`` if JSON can store it (numpy scalars, at any depth, become Python scalars), else TypeError naming
    it and, inside a dict or list, the item at fault."""
    value = _plain_scalars(value)
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as e:
        where, bad = _first_unstorable(value, "")
        inner = f" (its item {where}: a {type(bad).__module__}.{type(bad).__name__})" if where else ""
        raise TypeError(f"state entry {name!r}: a {type(value).__name__} is neither a tensor, a numpy array nor a "
                        f"JSON value (int, float, str, bool, None, list, dict){inner} ({e})") from None
    key = _non_str_key(value)
    if key is not None:
        raise TypeError(f"state entry {name!r}: a dict inside it has the {type(key).__name__} key {key!r}; JSON "
                        f"keys are strings, so it would load as {str(key)!r}. Use str keys (a dict directly in the "
                        f"state may have int keys: it is descended into, not stored as JSON)")
    return value


def plain_step(step):
    """A numpy integer step (``for step in np.arange(n)``) as the Python int it is; anything else unchanged."""
    return int(step) if isinstance(step, np.integer) else step


def _plain_scalars(value):
    """``value`` with numpy scalars (``np.float32(loss)``, ``np.int64(epoch)``) as Python scalars, at any depth of
    dicts, lists and tuples (a tuple stays a tuple); anything else as it is."""
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value.item()
    if isinstance(value, dict):
        return {k: _plain_scalars(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain_scalars(v) for v in value) if type(value) in (list, tuple) else value
    return value


def _first_unstorable(value, where: str) -> tuple:
    """(``[key][index]`` path, item) of the first item inside ``value`` JSON cannot store ("", None if none)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) \
        else ()
    for k, v in items:
        here = f"{where}[{k!r}]"
        if isinstance(v, (dict, list, tuple)):
            found = _first_unstorable(v, here)
            if found[0]:
                return found
        else:
            try:
                json.dumps(v, allow_nan=True)
            except (TypeError, ValueError):
                return here, v
    return "", None


def _non_str_key(value):
    """The first dict key inside ``value`` that JSON would turn into a string (None if none)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return k
            found = _non_str_key(v)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for v in value:
            found = _non_str_key(v)
            if found is not None:
                return found
    return None


def check_values(flat: dict) -> None:
    """TypeError for the first leaf that is neither a tensor, an array, a state leaf nor a JSON value (before a
    save communicates: collect would find it only between its reductions)."""
    import paddle

    from autoparallel.dist_tensor import DistTensor

    for name, (_, _, leaf) in flat.items():
        if not isinstance(leaf, (HeldElsewhere, ShardedLeaf, DistTensor, paddle.Tensor, np.ndarray)):
            json_value(name, leaf)
        locals_ = leaf.locals.values() if isinstance(leaf, DistTensor) or hasattr(leaf, "locals") else [leaf]
        if isinstance(leaf, (DistTensor, paddle.Tensor)) and any(
                isinstance(t, paddle.Tensor) and not t._is_initialized() and int(np.prod(t.shape)) > 0 for t in locals_):
            raise ValueError(f"{name!r} holds no data (a ZeRO stage-3 parameter released between steps, or a lazy "
                             f"parameter never drawn); save ap.training_state(model, optimizer), whose entries "
                             f"read the optimizer's chunks")


def to_numpy(t) -> np.ndarray:
    """A contiguous host copy of a paddle tensor or local shard (bfloat16 as its uint16 bit pattern)."""
    from autoparallel.local_mode import local_mode

    with local_mode():
        return np.require(t.numpy(), requirements="C")


def collect(flat: dict, rank: int, multi: bool) -> tuple:
    """(tensors, values, writes): metadata records without shards, JSON values, {rank: [(name, offsets, array)]}.

    ``multi``: a real multi-process job, where this process holds only ``rank``'s shards and only rank 0
    writes plain tensors and arrays. In one process every held shard is written by its owner's file.
    A ``ShardedLeaf`` names its own boxes and writers; ``HeldElsewhere`` entries are another rank's.
    """
    import paddle

    from autoparallel.dist_tensor import DistTensor, as_dist, is_dist, reshard
    from autoparallel.placement import Partial, Replicate
    from autoparallel.spec import normalize_dtype

    tensors, values, writes = {}, {}, {}
    for name, (_, _, leaf) in flat.items():
        if isinstance(leaf, HeldElsewhere):
            continue                                # its holder's rank records and writes it
        if isinstance(leaf, ShardedLeaf):
            tensors[name] = {"kind": "dist", "dtype": leaf.dtype, "shape": [int(s) for s in leaf.shape],
                             **leaf.layout_json()}
            for owner, offsets, array in leaf.saved_boxes():
                writes.setdefault(owner, []).append((name, tuple(offsets), np.require(array, requirements="C")))
        elif isinstance(leaf, DistTensor) or is_dist(leaf):
            dt = as_dist(leaf)
            if any(isinstance(p, Partial) for p in dt.spec.placements):
                # pending reductions are applied before saving: the file holds the value, not the terms
                dt = reshard(dt, dt.mesh, [Replicate() if isinstance(p, Partial) else p for p in dt.spec.placements])
            spec = dt.spec
            tensors[name] = {"kind": "dist", "dtype": spec.dtype, "shape": list(spec.shape),
                             "mesh": mesh_json(spec.mesh), "placements": [str(p) for p in spec.placements]}
            held = dt.locals
            for owner, offsets, shape, local in owned_pieces(spec):
                if owner not in held:
                    continue
                array = to_numpy(held[owner])
                if tuple(array.shape) != tuple(spec.local_shape(owner)):
                    raise ValueError(f"state entry {name!r}: rank {owner}'s local shard has shape "
                                     f"{list(array.shape)}, its spec {spec} expects {list(spec.local_shape(owner))}")
                array = np.require(array[local], requirements="C")    # keeps a 0-d shard 0-d
                if tuple(array.shape) != tuple(shape):
                    raise ValueError(f"state entry {name!r}: rank {owner}'s local shard has shape "
                                     f"{list(array.shape)}, its spec {spec} expects {list(shape)}")
                writes.setdefault(owner, []).append((name, offsets, array))
        elif isinstance(leaf, (paddle.Tensor, np.ndarray)):
            kind = "tensor" if isinstance(leaf, paddle.Tensor) else "ndarray"
            try:
                dtype = normalize_dtype(leaf.dtype)
            except ValueError as e:
                raise TypeError(f"state entry {name!r}: {e}") from None
            array = to_numpy(leaf) if kind == "tensor" else np.require(leaf, requirements="C")
            tensors[name] = {"kind": kind, "dtype": dtype, "shape": list(array.shape), "mesh": None,
                             "placements": None}
            if not multi or rank == 0:
                writes.setdefault(0, []).append((name, (0,) * array.ndim, array))
        else:
            values[name] = json_value(name, leaf)
    return tensors, values, writes
