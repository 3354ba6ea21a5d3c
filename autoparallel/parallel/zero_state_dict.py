"""paddle's ``optimizer.state_dict()`` / ``set_state_dict(sd)`` of a ZeRO optimizer (parallel/sharding.py).

ZeRO keeps, on rank r, chunk k of the flattened local shard of every parameter: an fp32 master chunk and the
chunk optimizer's accumulators of it. ``state_dict()`` names them as one process's paddle optimizer does
(``<param>_moment1_0``, ``<param>_beta1_pow_acc_0``, ``master_weights: {<param>: ...}`` for a low-precision
parameter of a ``multi_precision`` optimizer, ``LR_Scheduler``) and gives every element-wise state as a
distributed tensor of the whole parameter's shape:

* in the parameter's layout with the ZeRO axis ``Shard(0)`` where each rank's chunk is exactly its rows of
  dim 0 (the chunk boundaries fall on rows: a 1-D parameter, or rows divisible by the sharding degree). Then
  each rank's local value is a view of its live chunk (no communication, and a load in place reaches it);
* otherwise (chunk boundaries inside a row, HSDP ``degree < dp``, a tensor-parallel ``Shard(0)`` on a later
  mesh dim than the ZeRO axis) the chunks are gathered over the shard group (a collective: every rank calls
  ``state_dict()``) and laid out as above when that layout exists, else in the parameter's own layout.

Beta powers are plain tensors (every rank's are equal), as paddle keeps them. ``paddle.save`` refuses the
distributed values by name, ``ap.full_state_dict(opt)`` gathers what one process's ``state_dict()`` holds.

``set_state_dict(sd)`` takes, for every trainable parameter's states, a distributed tensor of any layout
(resharded to the parameter's, then cut into the chunks), or a value of the whole shape (a one-process state
dict: plain tensors or numpy); keys ending in another counter than ``_0`` (``<param>_moment1_3``) are matched
too. A missing state of a trainable parameter, a missing master weight or a wrong shape raise ValueError: never
a partial load. ``ap.load_state_dict`` / ``paddle.distributed.load_state_dict`` into a dict holding values
given by ``state_dict()`` write them back into the chunks afterwards (``write_back``), so a load in place
restores the optimizer whether or not ``set_state_dict`` follows.
"""
from __future__ import annotations

import math
import re
import weakref

import numpy as np

from autoparallel.checkpoint.load import AFTER_LOAD

_ISSUED: dict = {}          # id(value given by state_dict) -> (weakref to it, weakref to its optimizer, live)


def state_dict(zopt) -> dict:
    """One process's ``optimizer.state_dict()`` keys; element-wise states as distributed tensors."""
    import paddle

    from autoparallel.checkpoint.zero_state import _ensure_accumulators
    from autoparallel.local_mode import local_mode

    zopt.sync_trainable()
    _ensure_accumulators(zopt)
    out, masters = {}, {}
    with local_mode(), paddle.no_grad():
        for p in _stepped(zopt):
            geo = Geometry(zopt, p)
            base = _base(zopt, p)
            for acc, get in _accumulators(zopt, p):
                t = get(zopt.held[0])
                if _is_scalar(acc, t, geo):
                    out[f"{base}_{acc}_0"] = _scalar(zopt, get, geo)
                else:
                    out[f"{base}_{acc}_0"] = _issue(geo.value(get), zopt, geo.aligned)
            if _saves_master(zopt, p):
                masters[p.name] = _issue(geo.value(lambda r, p=p: zopt.master[r][id(p)]), zopt, geo.aligned)
    if masters:
        out["master_weights"] = masters
    sched = _scheduler(zopt)
    if sched is not None:
        out["LR_Scheduler"] = sched.state_dict()
    return out


def set_state_dict(zopt, sd, partial: bool = False) -> None:
    """Load ``sd`` (see the module doc) into every held rank's chunks; raises before writing on a bad entry.
    ``partial``: the entries ``sd`` holds only (a checkpoint loaded into a dict of some of them)."""
    import paddle

    from autoparallel.checkpoint.zero_state import _ensure_accumulators
    from autoparallel.local_mode import local_mode

    if not isinstance(sd, dict):
        raise TypeError(f"optimizer.set_state_dict expects a dict (optimizer.state_dict()'s form), got "
                        f"{type(sd).__name__}")
    zopt.sync_trainable()
    _ensure_accumulators(zopt)
    plan = _plan(zopt, sd, partial)
    with local_mode(), paddle.no_grad():
        writes = [(dests, geo.chunks(key, value, zopt)) if kind == "chunk" else (dests, _scalar_value(key, value))
                  for kind, key, value, geo, dests in plan]
        for dests, values in writes:
            if values is None:              # a live view given by this optimizer's state_dict: already there
                continue
            for r, dest in dests.items():
                _assign(dest, values if not isinstance(values, dict) else values[r])
    sched = _scheduler(zopt)
    if sched is not None and sd.get("LR_Scheduler"):
        sched.set_state_dict(sd["LR_Scheduler"])


def write_back_hook(state) -> None:
    write_back(state)          # looked up at each load (a test may replace write_back)


def write_back(state) -> None:
    """After a checkpoint was loaded into ``state``: every dict in it holding values a ZeRO optimizer's
    ``state_dict()`` gave is loaded into that optimizer (the values gathered there are copies of the chunks)."""
    if not isinstance(state, dict):
        return
    owners = []
    for k, v in state.items():
        if isinstance(v, dict):
            if k == "master_weights":                # loaded with the dict holding it
                owners += [o for o in map(_owner, v.values()) if o is not None]
            else:
                write_back(v)
            continue
        got = _owner(v)
        if got is not None:
            owners.append(got)
    done = set()
    for zopt in owners:
        if id(zopt) not in done:
            done.add(id(zopt))
            set_state_dict(zopt, state, partial=True)


# ---- geometry ---------------------------------------------------------------------------------------------
class Geometry:
    """Where rank r's chunk of ``p`` lies, and the layout its states are given in (``spec``, ``aligned``)."""

    def __init__(self, zopt, p):
        from autoparallel.placement import BlockShard, Replicate, Shard
        from autoparallel.spec import DistSpec

        self.zopt, self.p = zopt, p
        g, i = zopt.groups, zopt.groups.dp_index
        pl = list(p.placements)
        nested = any(isinstance(x, Shard) and x.dim == 0 and j > i for j, x in enumerate(pl))
        if p.spec.shape and isinstance(pl[i], Replicate) and not nested and \
                not any(isinstance(x, BlockShard) for x in pl):
            pl[i] = Shard(0)
        self.placements = pl
        self.spec = DistSpec(p.mesh, pl, list(p.spec.shape), "float32")
        self.layouts = {r: zopt._layout([p], r) for r in zopt.held}
        self.aligned = pl != list(p.placements) and g.degree == g.dp and all(
            self._rows(r) is not None for r in p.mesh.process_ids)

    def range(self, r):
        layout = self.layouts.get(r) or self.zopt._layout([self.p], r)
        k = self.zopt.groups.index(r)
        return layout.starts[0][k], layout.sizes[0][k]

    def _rows(self, r):
        """(first, count) of rank r's rows of dim 0 in its local shard under ``spec``, when its chunk is
        exactly those rows; else None."""
        coords = self.p.mesh.coords_of(r)
        a, _ = self.p.spec.local_range(coords, 0)
        a2, b2 = self.spec.local_range(coords, 0)
        row = math.prod(self.p.spec.local_shape(r)[1:])
        start, size = self.range(r)
        if size == 0 and b2 == a2:
            return a2 - a, 0
        return (a2 - a, b2 - a2) if (start, size) == ((a2 - a) * row, (b2 - a2) * row) else None

    def value(self, get):
        """The distributed tensor over the chunks ``get(r)`` (views when aligned, else gathered)."""
        from autoparallel.dist_tensor import DistTensor
        from autoparallel.spec import DistSpec, normalize_dtype

        held = self.zopt.held
        dtype = normalize_dtype(get(held[0]).dtype)
        if self.aligned:
            locals_ = {r: get(r).reshape(list(self.spec.local_shape(r))) for r in held}
            return DistTensor(locals_, DistSpec(self.p.mesh, self.placements, list(self.p.spec.shape), dtype))
        whole = self._gather(get)
        locals_ = {}
        for r in held:
            local = whole[r].reshape(list(self.p.spec.local_shape(r)))
            if self.placements != list(self.p.placements):
                a, _ = self.p.spec.local_range(self.p.mesh.coords_of(r), 0)
                a2, b2 = self.spec.local_range(self.p.mesh.coords_of(r), 0)
                local = local[a2 - a:b2 - a].clone()
            locals_[r] = local
        return DistTensor(locals_, DistSpec(self.p.mesh, self.placements, list(self.p.spec.shape), dtype))

    def _gather(self, get) -> dict:
        """{held rank: its whole local shard, flat} from every member's chunk (one all-gather per group)."""
        from autoparallel.comm import collectives as C
        from autoparallel.parallel.zero_groups import apply_groups

        zopt = self.zopt

        def gather(v, ranks):           # a group of one (ZeRO degree 1) is its own result
            # the group's own chunk width: an unevenly split tensor-parallel dim gives groups different widths
            width = self.layouts[next(iter(v))].width
            return dict(v) if len(ranks) == 1 else C._gather_raw(v, ranks, 0, [width] * len(ranks))

        xs = {r: self.layouts[r].pack_member([get(r)], zopt.groups.index(r)) for r in zopt.held}
        out = apply_groups(xs, zopt.groups.shard_groups, gather)
        return {r: self.layouts[r].unpack_full(out[r])[0] for r in zopt.held}

    def chunks(self, key, value, zopt):
        """{held rank: its flat chunk of ``value``}, or None for a live view of this optimizer's chunks."""
        from autoparallel.dist_tensor import as_dist, is_dist, reshard

        p, want = self.p, list(self.p.spec.shape)
        if is_dist(value):
            v = as_dist(value)
            owner = _ISSUED.get(id(v))
            if owner is not None and owner[0]() is v and owner[1]() is zopt and owner[2]:
                return None
            if list(v.spec.shape) != want:
                raise ValueError(_shape_error(key, p, list(v.spec.shape)))
            if self.aligned and v.mesh == p.mesh and list(v.placements) == self.placements:
                return {r: v.local_of(r).reshape([-1]) for r in zopt.held}
            src = reshard(v, p.mesh, p.placements)
            locals_ = {r: src.local_of(r).reshape([-1]) for r in zopt.held}
        else:
            arr = _array(value)
            if list(arr.shape) != want:
                raise ValueError(_shape_error(key, p, list(arr.shape)))
            locals_ = {r: np.ascontiguousarray(arr[p.spec.local_slices(p.mesh.coords_of(r))]).reshape(-1)
                       for r in zopt.held}
        out = {}
        for r, flat in locals_.items():
            start, size = self.range(r)
            out[r] = flat[start:start + size]
        return out


def _shape_error(key, p, got) -> str:
    return (f"optimizer.set_state_dict under ZeRO: {key!r} (a state of {p.name}) has shape {got}; expected the "
            f"whole parameter's shape {list(p.spec.shape)} (a distributed tensor of any layout, or a plain value)")


# ---- what the chunk optimizers hold ---------------------------------------------------------------------------
def _stepped(zopt) -> list:
    """The parameters with a trainable master chunk (frozen ones have no optimizer state, as in paddle)."""
    if not zopt.held:
        return []
    r0 = zopt.held[0]
    return [p for p in zopt.params if id(p) in zopt.master[r0] and not zopt.master[r0][id(p)].stop_gradient]


def _accumulators(zopt, p) -> list:
    """[(accumulator name, rank -> tensor)] of ``p``'s chunk, in a sorted order (the same on every rank)."""
    r0 = zopt.held[0]
    name = zopt.master[r0][id(p)].name
    accs = zopt.inner_opts[r0]._accumulators
    return [(acc, lambda r, acc=acc: zopt.inner_opts[r]._accumulators[acc][zopt.master[r][id(p)].name])
            for acc in sorted(accs) if name in accs[acc]]


def _is_scalar(acc, t, geo) -> bool:
    from autoparallel.checkpoint.zero_state import SCALAR_ACCUMULATORS

    return acc in SCALAR_ACCUMULATORS or list(t.shape) != [geo.range(geo.zopt.held[0])[1]]


def _saves_master(zopt, p) -> bool:
    from autoparallel.checkpoint.zero_state import _saves_master as saves

    return saves(zopt, p)


def _base(zopt, p) -> str:
    """paddle keys a master-weighted parameter's accumulators by its master weight's name."""
    return f"{p.name}_fp32_master_0" if _saves_master(zopt, p) else p.name


def _scheduler(zopt):
    from paddle.optimizer.lr import LRScheduler

    lr = getattr(zopt._inner, "_learning_rate", None)
    return lr if isinstance(lr, LRScheduler) else None


def _scalar(zopt, get, geo):
    """A per-parameter scalar (a beta power): a held rank's own, from one with a non-empty chunk if any."""
    ranks = [r for r in zopt.held if geo.range(r)[1]] or zopt.held
    return get(ranks[0])


# ---- loading --------------------------------------------------------------------------------------------------
def _plan(zopt, sd, partial: bool = False) -> list:
    """[(kind, key, value, geometry, {held rank: destination tensor})] for every state, checked complete."""
    masters = sd.get("master_weights") or {}
    plan, missing = [], []
    for p in _stepped(zopt):
        geo = Geometry(zopt, p)
        for acc, get in _accumulators(zopt, p):
            key = _find(sd, p, acc)
            if key is None:
                missing.append(f"{_base(zopt, p)}_{acc}_0")
                continue
            kind = "scalar" if _is_scalar(acc, get(zopt.held[0]), geo) else "chunk"
            plan.append((kind, key, sd[key], geo, {r: get(r) for r in zopt.held}))
        if _saves_master(zopt, p):
            if p.name not in masters:
                missing.append(f"master_weights[{p.name!r}]")
                continue
            plan.append(("chunk", p.name, masters[p.name], geo, {r: zopt.master[r][id(p)] for r in zopt.held}))
    if missing and not partial and (plan or _has_states(sd)):
        raise ValueError(f"optimizer.set_state_dict under ZeRO (sharding stage {zopt.stage}): the state dict lacks "
                         f"{len(missing)} states this optimizer keeps ({', '.join(missing[:4])}"
                         f"{', ...' if len(missing) > 4 else ''}); give a whole optimizer.state_dict() (the "
                         f"same parameter names: build the model under the same paddle.utils.unique_name)")
    return plan


def _has_states(sd) -> bool:
    return any(k not in ("LR_Scheduler", "master_weights") for k in sd) or bool(sd.get("master_weights"))


def _find(sd, p, acc):
    """The key of ``p``'s accumulator ``acc`` in ``sd``: ``<param>_<acc>_<n>`` or, for a master-weighted
    parameter in one process's dict, ``<param>_fp32_master_<m>_<acc>_<n>``."""
    exact = f"{p.name}_{acc}_0"
    if exact in sd:
        return exact
    pat = re.compile(rf"{re.escape(p.name)}(_fp32_master_\d+)?_{re.escape(acc)}_\d+")
    found = sorted(k for k in sd if isinstance(k, str) and pat.fullmatch(k))
    if len(found) > 1:
        raise ValueError(f"optimizer.set_state_dict under ZeRO: {len(found)} keys name the {acc} of {p.name} "
                         f"({', '.join(found[:3])}); give one")
    return found[0] if found else None


def _scalar_value(key, value):
    arr = _array(value)
    if arr.size != 1:
        raise ValueError(f"optimizer.set_state_dict under ZeRO: {key!r} is a per-parameter scalar, got shape "
                         f"{list(arr.shape)}")
    return arr.reshape([1])


def _array(value) -> np.ndarray:
    from autoparallel.dist_tensor import is_dist

    if is_dist(value):
        return np.asarray(value.full().numpy())
    if hasattr(value, "numpy"):
        return value.numpy()
    if isinstance(value, (np.ndarray, np.generic, float, int, list)):
        return np.asarray(value)
    raise TypeError(f"optimizer.set_state_dict under ZeRO: expected a tensor or numpy array, got "
                    f"{type(value).__name__}")


def _assign(dest, value) -> None:
    import paddle

    src = value if isinstance(value, paddle.Tensor) else paddle.to_tensor(np.asarray(value))
    if src.dtype != dest.dtype:
        src = src.astype(dest.dtype)
    if list(src.shape) != list(dest.shape):
        src = src.reshape(list(dest.shape))
    if src.place != dest.place:
        src = src._copy_to(dest.place, True)
    paddle.assign(src, output=dest)


# ---- values given out ---------------------------------------------------------------------------------------
def _issue(value, zopt, live: bool):
    """Remember which optimizer gave ``value`` (and whether its locals are views of the live chunks)."""
    key = id(value)
    _ISSUED[key] = (weakref.ref(value, lambda _r, k=key: _ISSUED.pop(k, None)), weakref.ref(zopt), live)
    return value


def _owner(v):
    got = _ISSUED.get(id(v))
    if got is None or got[0]() is not v:
        return None
    return got[1]()


if write_back_hook not in AFTER_LOAD:
    AFTER_LOAD.append(write_back_hook)
