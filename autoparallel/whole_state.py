"""Optimizer states as one process holds them, on real ranks: every state of a distributed parameter (a moment
laid out as its parameter's local shard) gathered into its whole value. Collective: every rank calls it, and
the states are visited in one sorted order."""
from __future__ import annotations


def optimizer_whole(model, opt, structured: bool = False) -> dict:
    """``opt.state_dict()`` (without ``LR_Scheduler``) with whole values; keys as paddle's (``{param.name}_{state}``),
    or with ``structured`` as paddle's ``optimizer.sharded_state_dict`` names them (``{struct_name}.{state}``, a tied
    parameter under its first name in sorted order)."""
    import paddle

    from autoparallel.dist_tensor import dtensor_from_local, is_dist

    owners = {}
    for key, p in sorted(model.state_dict().items()):
        owners.setdefault(p.name, (key, p))
    state = dict(opt.state_dict())
    state.pop("LR_Scheduler", None)
    if state.pop("master_weights", None):
        raise NotImplementedError("optimizer master weights over a model distributed by autoparallel, gathered "
                                  "for a one-process checkpoint: use Strategy.amp (no master weights in the optimizer)")
    out = {}
    for key in sorted(state):
        base = max((n for n in owners if key.startswith(n + "_")), key=len, default=None)
        if base is None:
            raise ValueError(f"optimizer state {key!r} names no parameter of {type(model).__name__}")
        struct, p = owners[base]
        t = state[key]
        if is_dist(t):                          # a sharded state, as the ap optimizer's state_dict gives it
            t = t.full()
            t = paddle.to_tensor(t.numpy()) if is_dist(t) else t
        elif is_dist(p) and t.ndim and list(t.shape) == list(p.shape):
            t = dtensor_from_local(t, p.mesh, p.placements).full()
        out[f"{struct}.{key[len(base) + 1:]}" if structured else key] = t.detach().clone()
    return out
