"""Stable names for a model's and a paddle optimizer's state, the same under every layout and restart.

paddle names parameters and optimizer accumulators with a process-wide counter ("linear_3.w_0_moment1_0"),
which changes with construction order. ``training_state`` names them by the model's structured parameter
names instead:

```
{"model":     {"fc1.weight": <param>, ...},
 "optimizer": {"fc1.weight": {"moment1": <tensor>, "beta1_pow_acc": <tensor>, ...}, ...}}
```

Accumulators shaped like a DistParameter's local shard are given that parameter's layout (so they reshard
with it); other accumulators (scalars such as beta powers) are plain tensors. Accumulators are created if
the optimizer has not stepped yet, so a fresh optimizer can be loaded into. This covers paddle optimizers
whose state lives in ``_accumulators`` / ``_master_weights`` on the rank this process runs (through the ap
wrappers: ShardedOptimizer, AmpOptimizer) and, in the simulated world, on every simulated rank (the per-rank
optimizers of parallel/sim_step.py: one global tensor over all ranks' accumulators). Runtimes that keep state differently name it the same way
through their ``checkpoint_state``: a ZeRO optimizer (zero_state.py: flat chunks as global tensors) and a
pipeline (pipeline_state.py: each stage's ranks hold their stage's entries), so checkpoints of every
strategy are interchangeable.
"""
from __future__ import annotations

from autoparallel.parallel.param_list import flat_params


def model_state(model) -> dict:
    """{structured name: parameter} of a paddle Layer (DistParameters keep their layout)."""
    return {name: p for name, p in model.named_parameters()}


def optimizer_state(optimizer, model, wrapper=None) -> dict:
    """{structured parameter name: {accumulator name: tensor}} of a paddle optimizer over ``model``.

    Only the parameters ``optimizer`` steps are named. In the simulated world ``wrapper`` (the ap wrapper
    around ``optimizer``) also holds the other ranks' optimizers (parallel/sim_step.py): each accumulator is
    then one global tensor over every rank's copy, scalars (beta powers) replicated."""
    from autoparallel.compat import main_global_block

    by_id = {p.name: (name, p) for name, p in model.named_parameters()}
    stepped = {p.name for p in flat_params(optimizer)}
    by_id = {k: v for k, v in by_id.items() if k in stepped}
    trainable = [p for _, p in by_id.values() if not p.stop_gradient]
    missing = [p for p in trainable if p.name not in getattr(optimizer, "_already_create_accumulator", set())]
    if missing:
        optimizer._create_accumulators(main_global_block(), missing)
    owner = dict(by_id)           # multi_precision keys a low-precision parameter's moments by its master weight
    for pname, master in getattr(optimizer, "_master_weights", {}).items():
        if pname in by_id:
            owner[master.name] = by_id[pname]
    copies = _sim_copies(wrapper, [p for _, p in by_id.values()]) if wrapper is not None else None
    out: dict = {}
    for acc_name, per_param in getattr(optimizer, "_accumulators", {}).items():
        for pname, tensor in per_param.items():
            if pname not in owner:
                continue
            name, param = owner[pname]
            out.setdefault(name, {})[acc_name] = _wrap(name, param, tensor, copies,
                                                       lambda o, s, a=acc_name: _lookup(o, a, s))
    for pname, tensor in getattr(optimizer, "_master_weights", {}).items():
        if pname in by_id:
            name, param = by_id[pname]
            out.setdefault(name, {})["master_weight"] = _wrap(name, param, tensor, copies,
                                                              lambda o, s: o._master_weights.get(s))
    return out


def _lookup(opt, acc_name, shadow_name):
    master = getattr(opt, "_master_weights", {}).get(shadow_name)
    per_param = opt._accumulators.get(acc_name, {})
    return per_param.get(master.name if master is not None else shadow_name, per_param.get(shadow_name))


def _wrap(name, param, tensor, copies, find):
    """``tensor`` (the lowest held rank's accumulator of ``param``) as the tensor a checkpoint names."""
    from autoparallel.dist_tensor import DistTensor, is_dist
    from autoparallel.placement import Replicate
    from autoparallel.spec import DistSpec, normalize_dtype

    if not is_dist(param):
        return tensor
    dtype = normalize_dtype(tensor.dtype)
    elementwise = list(tensor.shape) == list(param.shape)
    if len(param.locals) == 1:
        if not elementwise:
            return tensor
        spec = param.spec
        return DistTensor({next(iter(param.locals)): tensor}, DistSpec(spec.mesh, spec.placements, spec.shape, dtype))
    if copies is None:
        raise ValueError(f"parameter {name!r} holds {len(param.locals)} ranks' shards in this process (the "
                         f"simulated world) but its optimizer keeps one accumulator and no per-rank copies "
                         f"(ap.shard_optimizer / ap.Optimizer / ap.parallelize keep them)")
    per_rank = {}
    for r, t in sorted(param.locals.items()):
        per_rank[r] = tensor if t is param else _rank_tensor(name, param, r, t, tensor, copies, find, elementwise)
    spec = param.spec
    if elementwise:
        return DistTensor(per_rank, DistSpec(spec.mesh, spec.placements, spec.shape, dtype))
    return DistTensor(per_rank, DistSpec(spec.mesh, [Replicate()] * spec.mesh.ndim, list(tensor.shape), dtype))


def _rank_tensor(name, param, r, t, tensor, copies, find, elementwise):
    """Rank r's accumulator of ``param``: its per-rank optimizer's, or that of the copy sharing its storage."""
    import paddle

    from autoparallel.parallel.sim_step import _buffer

    opt, links = copies.opts.get(r, (None, []))
    for local, shadow in links:
        if local is t:
            got = find(opt, shadow.name)
            if got is None:
                raise KeyError(f"no {name!r} accumulator on simulated rank {r}")
            return got
    if elementwise and not int(t.numel()):
        return paddle.zeros(t.shape, tensor.dtype)        # an empty shard: nothing to step, nothing to keep
    if _buffer(t) == _buffer(param):
        return tensor
    for q, other in sorted(param.locals.items()):         # storage shared with another rank's updated copy
        if q != r and other is not t and _buffer(other) == _buffer(t):
            return _rank_tensor(name, param, q, other, tensor, copies, find, elementwise)
    raise KeyError(f"simulated rank {r}'s copy of {name!r} is stepped by no optimizer")


def _sim_copies(wrapper, params):
    """The simulated world's per-rank optimizers of ``wrapper`` (built as its first step builds them, with
    their accumulators created), or None outside the simulated world."""
    from autoparallel.comm.world import current_world
    from autoparallel.compat import main_global_block

    if not current_world().is_simulated:
        return None
    for w in wrapper_chain(wrapper):
        if not callable(getattr(type(w), "_step_other_ranks", None)):
            continue
        inner = vars(w).get("_inner")
        if not hasattr(type(inner), "_create_accumulators"):
            return None
        ps = w.parameters
        key = tuple(id(p) for p in ps)
        got = vars(w).get("_rank_copies")
        if got is None or got[0] != key:
            from autoparallel.parallel.sim_step import RankCopies

            got = w.__dict__["_rank_copies"] = (key, RankCopies(inner, ps))
        for opt, links in got[1].opts.values():
            todo = [s for _, s in links if not s.stop_gradient
                    and s.name not in getattr(opt, "_already_create_accumulator", set())]
            if todo:
                opt._create_accumulators(main_global_block(), todo)
        return got[1]
    return None


def training_state(model, optimizer=None) -> dict:
    """The state ``save_state_dict`` / ``load_state_dict`` / ``reshard_state`` move for a training run.

    ``model``: a paddle Layer (parallelized or not) or a PipelineModule; ``optimizer``: a paddle optimizer
    or any ap wrapper of one, including a ZeRO optimizer. The optimizer's LR scheduler, if any, is saved and
    restored with the tensors (``TrainingState``)."""
    return TrainingState(_tensors(model, optimizer), optimizer)


class TrainingState(dict):
    """``training_state``'s dict; ``optimizer`` names the optimizer whose LR scheduler ``save_state_dict``
    saves beside the tensors and ``load_state_dict`` restores (checkpoint/runtime_state.py)."""

    def __init__(self, state: dict, optimizer=None):
        super().__init__(state)
        self.optimizer = optimizer


def _tensors(model, optimizer) -> dict:
    if optimizer is not None and callable(getattr(optimizer, "checkpoint_state", None)):
        return optimizer.checkpoint_state(model)             # ZeRO (through any wrapper)
    if callable(getattr(model, "checkpoint_state", None)):
        return model.checkpoint_state(optimizer)
    import paddle

    if not isinstance(model, paddle.nn.Layer):
        raise TypeError(f"model must be a paddle.nn.Layer or a PipelineModule, got {type(model).__name__}")
    state = {"model": model_state(model)}
    if optimizer is not None:
        state["optimizer"] = optimizer_state(paddle_optimizer(optimizer), model, optimizer)
    return state


def wrapper_chain(optimizer):
    """``optimizer`` and the ones it wraps (ShardedOptimizer ``_inner``, AmpOptimizer ``optimizer``), outermost
    first; wrappers nest a few levels at most."""
    for _ in range(8):
        if optimizer is None:
            return
        yield optimizer
        own = vars(optimizer) if hasattr(optimizer, "__dict__") else {}
        optimizer = own.get("_inner", own.get("optimizer"))


def paddle_optimizer(optimizer):
    """The paddle optimizer inside the ap wrappers (ShardedOptimizer ``_inner``, AmpOptimizer ``optimizer``)."""
    for opt in wrapper_chain(optimizer):
        if hasattr(type(opt), "_create_accumulators"):
            return opt
    raise TypeError(f"expected a paddle optimizer or an ap wrapper of one, got {type(optimizer).__name__}")
