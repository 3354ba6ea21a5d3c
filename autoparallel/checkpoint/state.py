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
wrappers: ShardedOptimizer, AmpOptimizer). Runtimes that keep state differently name it the same way
through their ``checkpoint_state``: a ZeRO optimizer (zero_state.py: flat chunks as global tensors) and a
pipeline (pipeline_state.py: each stage's ranks hold their stage's entries), so checkpoints of every
strategy are interchangeable.
"""
from __future__ import annotations


def model_state(model) -> dict:
    """{structured name: parameter} of a paddle Layer (DistParameters keep their layout)."""
    return {name: p for name, p in model.named_parameters()}


def optimizer_state(optimizer, model) -> dict:
    """{structured parameter name: {accumulator name: tensor}} of a paddle optimizer over ``model``."""
    from paddle.base import framework

    from autoparallel.dist_tensor import DistTensor, is_dist
    from autoparallel.spec import DistSpec, normalize_dtype

    by_id = {p.name: (name, p) for name, p in model.named_parameters()}
    trainable = [p for _, p in by_id.values() if not p.stop_gradient]
    missing = [p for p in trainable if p.name not in getattr(optimizer, "_already_create_accumulator", set())]
    if missing:
        optimizer._create_accumulators(framework.default_main_program().global_block(), missing)
    owner = dict(by_id)           # multi_precision keys a low-precision parameter's moments by its master weight
    for pname, master in getattr(optimizer, "_master_weights", {}).items():
        if pname in by_id:
            owner[master.name] = by_id[pname]
    out: dict = {}

    def wrap(param, tensor):
        if is_dist(param) and list(tensor.shape) == list(param.shape):
            if len(param.locals) > 1:
                raise ValueError(f"parameter {by_id[param.name][0]!r} holds {len(param.locals)} ranks' shards in "
                                 f"this process (the simulated world) but its optimizer keeps one accumulator: "
                                 f"pass a state_fn that names every rank's optimizer state")
            spec = param.spec
            spec = DistSpec(spec.mesh, spec.placements, spec.shape, normalize_dtype(tensor.dtype))
            rank = min(r for r, t in param.locals.items() if t is param)
            return DistTensor({rank: tensor}, spec)
        return tensor

    for acc_name, per_param in getattr(optimizer, "_accumulators", {}).items():
        for pname, tensor in per_param.items():
            if pname not in owner:
                continue
            name, param = owner[pname]
            out.setdefault(name, {})[acc_name] = wrap(param, tensor)
    for pname, tensor in getattr(optimizer, "_master_weights", {}).items():
        if pname in by_id:
            name, param = by_id[pname]
            out.setdefault(name, {})["master_weight"] = wrap(param, tensor)
    return out


def training_state(model, optimizer=None) -> dict:
    """The state ``save_state_dict`` / ``load_state_dict`` / ``reshard_state`` move for a training run.

    ``model``: a paddle Layer (parallelized or not) or a PipelineModule; ``optimizer``: a paddle optimizer
    or any ap wrapper of one, including a ZeRO optimizer."""
    if optimizer is not None and callable(getattr(optimizer, "checkpoint_state", None)):
        return optimizer.checkpoint_state(model)             # ZeRO (through any wrapper)
    if callable(getattr(model, "checkpoint_state", None)):
        return model.checkpoint_state(optimizer)
    import paddle

    if not isinstance(model, paddle.nn.Layer):
        raise TypeError(f"model must be a paddle.nn.Layer or a PipelineModule, got {type(model).__name__}")
    state = {"model": model_state(model)}
    if optimizer is not None:
        state["optimizer"] = optimizer_state(paddle_optimizer(optimizer), model)
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
