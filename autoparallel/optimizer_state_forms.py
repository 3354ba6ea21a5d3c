"""``optimizer.state_dict()`` / ``set_state_dict()`` of an optimizer over distributed parameters (``shard_optimizer``,
``ap.parallelize``, ``ap.Optimizer``).

paddle's optimizer state dict holds each parameter's moments as plain tensors of the parameter's *local* shape:
under tensor parallelism a shard of each Adam moment, keyed by the whole parameter's accumulator name.
``paddle.save(opt.state_dict(), p)`` wrote those shards as if they were the whole moments, with no complaint, and
``set_state_dict`` of that file into a one-process optimizer loaded wrong-shaped moments (or paddle skipped them:
a silent optimizer restart).

Here the states of a parameter that is not replicated (sharded or partial on some mesh dim) are returned as
distributed tensors in their parameter's layout (the tensors ``ap.training_state`` names: the live accumulators,
in the simulated world one global tensor over every rank's copy). So:

* ``paddle.save(opt.state_dict(), p)`` refuses them by name (export_save.py: a shard is never saved as the whole);
  ``ap.full_state_dict(opt)`` (collective) gives what one process's ``opt.state_dict()`` holds, to save on one rank;
* ``opt.set_state_dict(d)`` takes, for such a state, a distributed value (resharded to the parameter's layout), a
  value of the whole parameter's shape (a one-process file: laid out) or of this rank's shard's shape (this rank's
  own shard, kept as paddle keeps it); any other shape raises ValueError.

States of replicated parameters (data parallelism) and scalars (beta powers) stay as paddle gives them.
ZeRO optimizers give their own (parallel/zero_state_dict.py: the chunks as distributed tensors).
"""
from __future__ import annotations

import numpy as np

from autoparallel import patches


def install() -> None:
    from autoparallel.parallel.optimizer import ShardedOptimizer

    if getattr(vars(ShardedOptimizer).get("state_dict"), "_ap_wrapper", False):
        return
    patches.patch(ShardedOptimizer, "state_dict", _state_dict)
    patches.patch(ShardedOptimizer, "set_state_dict", _set_state_dict(ShardedOptimizer.set_state_dict))
    import paddle

    P = paddle.optimizer.Optimizer
    patches.patch(P, "state_dict", _plain(P.state_dict, "state_dict"))
    patches.patch(P, "set_state_dict", _plain(P.set_state_dict, "set_state_dict"))


def _plain(orig, name):
    """A plain paddle optimizer over distributed parameters (stepped through its ShardedOptimizer:
    parallel/implicit_optimizer.py) gives and takes its state dict through that wrapper too."""
    def method(self, *args, **kwargs):
        from autoparallel.parallel.implicit_optimizer import needs_wrapper, wrapper_for

        if needs_wrapper(self):
            return getattr(wrapper_for(self), name)(*args, **kwargs)
        return orig(self, *args, **kwargs)

    method._ap_wrapper = True
    method.__wrapped__ = orig
    return method


def _sharded(p) -> bool:
    from autoparallel.dist_tensor import is_dist
    from autoparallel.placement import Replicate

    return is_dist(p) and any(not isinstance(pl, Replicate) for pl in p.placements)


def _owners(wrapper, inner) -> dict:
    """{accumulator or master-weight tensor name: (its parameter, accumulator kind or "master_weight", the tensor)}
    for the states of sharded parameters."""
    params = {p.name: p for p in wrapper.parameters if _sharded(p)}
    owner = dict(params)
    masters = getattr(inner, "_master_weights", {}) or {}
    for pname, master in masters.items():
        if pname in params:
            owner[master.name] = params[pname]
    out = {}
    for kind, per_param in getattr(inner, "_accumulators", {}).items():
        for pname, t in per_param.items():
            if pname in owner:
                out[t.name] = (owner[pname], kind, t)
    for pname, t in masters.items():
        if pname in params:
            out[pname] = (params[pname], "master_weight", t)
    return out


def _distributed(wrapper, owners: dict) -> dict:
    """{state name: DistTensor over the live accumulators} (checkpoint/state.py's layout of them)."""
    from autoparallel.checkpoint.state import _lookup, _sim_copies, _wrap

    if not owners:
        return {}
    copies = _sim_copies(wrapper, wrapper.parameters)
    out = {}
    for key, (p, kind, t) in owners.items():
        find = (lambda o, s: o._master_weights.get(s)) if kind == "master_weight" else \
            (lambda o, s, a=kind: _lookup(o, a, s))
        try:
            out[key] = _wrap(p.name, p, t, copies, find)
        except KeyError as e:               # the simulated world's per-rank copies keep no such state
            raise NotImplementedError(
                f"optimizer.state_dict() in the simulated world: the {kind} of {p.name} (layout "
                f"{[str(x) for x in p.placements]}) is not kept per simulated rank ({e}), so its global value "
                f"is not known here; this state dict is available on real ranks") from None
    return out


def _state_dict(self):
    from autoparallel.dist_tensor import is_dist

    from autoparallel.local_mode import local_mode

    inner = self._inner
    with local_mode():
        state = inner.state_dict()
    owners = _owners(self, inner)
    if not owners:
        return state
    from autoparallel.export_forms import not_whole

    dist = {k: v for k, v in _distributed(self, owners).items() if is_dist(v) and not_whole(v)}
    state = dict(state)
    state.update({k: v for k, v in dist.items() if k in state})
    if "master_weights" in state:
        state["master_weights"] = {k: dist.get(k, v) for k, v in state["master_weights"].items()}
    return state


_state_dict._ap_wrapper = True


def _named_owners(wrapper, state_dict: dict) -> dict:
    """{state name in ``state_dict``: (sharded parameter, kind)}, by paddle's naming (``{param.name}_{state}_{n}``,
    master weights under the parameter's name): the optimizer may not have created its accumulators yet."""
    params = {p.name: p for p in wrapper.parameters if _sharded(p)}
    out = {}
    for key in state_dict:
        base = max((n for n in params if str(key).startswith(n + "_")), key=len, default=None)
        if base is not None:
            out[key] = (params[base], str(key)[len(base) + 1:])
    for pname in (state_dict.get("master_weights", {}) or {}):
        if pname in params:
            out[pname] = (params[pname], "master_weight")
    return out


def _set_state_dict(orig):
    def set_state_dict(self, state_dict):
        from autoparallel.local_mode import local_mode

        inner = self._inner
        owners = _named_owners(self, state_dict) if isinstance(state_dict, dict) else {}
        per_rank = _per_rank(state_dict, owners) if owners else {}
        if not per_rank:
            with local_mode():              # paddle's, on the inner optimizer itself (implicit_optimizer.py)
                return orig(self, state_dict)
        own = dict(state_dict)
        masters = dict(own.get("master_weights", {}) or {})
        for key, (p, _) in owners.items():
            if key in per_rank:
                value = per_rank[key][min(p.locals)]        # this rank's (the lowest simulated rank's)
                if key in masters:
                    masters[key] = value
                if key in own:
                    own[key] = value
        if masters:
            own["master_weights"] = masters
        with local_mode():
            out = inner.set_state_dict(own)
        _load_other_ranks(self, state_dict, per_rank)
        return out

    set_state_dict._ap_wrapper = True
    set_state_dict.__wrapped__ = orig
    return set_state_dict


def _entries(state_dict: dict, owners: dict) -> dict:
    masters = state_dict.get("master_weights", {}) or {}
    got = {k: state_dict[k] for k in owners if k in state_dict}
    got.update({k: masters[k] for k in owners if k in masters})
    return got


def _per_rank(state_dict: dict, owners: dict) -> dict:
    """{state name: {rank: local value}} for the states of sharded parameters in ``state_dict``."""
    from autoparallel.dist_tensor import as_dist, is_dist, reshard, shard_tensor

    out = {}
    for key, value in _entries(state_dict, owners).items():
        p, _ = owners[key]
        shape = list(value.spec.shape) if is_dist(value) else \
            list(value.shape) if hasattr(value, "shape") else list(np.shape(value))
        if len(shape) != len(p.global_shape) or (int(np.prod(shape)) <= 1 < int(np.prod(p.global_shape))):
            continue                                      # a scalar state (a beta power): every rank's
        if is_dist(value):
            src = reshard(as_dist(value), p.mesh, p.placements)
        else:
            if shape == list(p.shape) and shape != list(p.global_shape):
                if len(p.locals) > 1:
                    raise NotImplementedError(
                        f"optimizer.set_state_dict in the simulated world: {key!r} has the shape of one shard "
                        f"{shape} of {p.name} ({[str(x) for x in p.placements]}), and every simulated rank holds "
                        f"another shard; give the whole state (ap.full_state_dict(optimizer)) or a distributed one "
                        f"(optimizer.state_dict())")
                continue                                  # this rank's own shard, as paddle loads it
            if shape != list(p.global_shape):
                raise ValueError(f"optimizer.set_state_dict: {key!r} (state of {p.name}, layout "
                                 f"{[str(x) for x in p.placements]}) has shape {shape}; expected the whole "
                                 f"parameter's shape {list(p.global_shape)} or this rank's shard's {list(p.shape)}")
            src = shard_tensor(_tensor(value), p.mesh, p.placements)
        out[key] = {r: src.local_of(r) for r in p.locals}
    return out


def _tensor(value):
    import paddle

    return value if isinstance(value, paddle.Tensor) else paddle.to_tensor(np.asarray(value))


def _load_other_ranks(wrapper, state_dict, per_rank) -> None:
    """The simulated world: every other rank's optimizer copy takes its own rank's states (parallel/sim_step.py)."""
    from autoparallel.checkpoint.state import _sim_copies

    copies = _sim_copies(wrapper, wrapper.parameters)
    if copies is None:
        return
    rank_states = {}
    for r in copies.opts:
        sub = {k: v for k, v in state_dict.items() if k not in per_rank}
        sub.update({k: v[r] for k, v in per_rank.items() if r in v})
        rank_states[r] = sub
    copies.load_state(state_dict, rank_states)
