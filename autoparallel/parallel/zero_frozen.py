"""Frozen parameters under ZeRO cost no optimizer state: a parameter that is frozen (``stop_gradient``) when the
ZeRO optimizer is built gets no fp32 master chunk at stages 1/2 (its local data is its only copy) and no
bucket slot; its moments were never created (paddle creates them at a parameter's first gradient). When it
is unfrozen, the next step creates its master chunk from its current value and adds it to the chunk
optimizer, which creates its moments at that step -- as one process, whose optimizer creates a late
parameter's master weight and moments (beta powers starting over) at its first gradient.

At stage 3 the chunk is the parameter's storage, so a frozen one keeps it, in the parameter's own dtype (a
bf16 frozen base costs its bf16 bytes, not fp32's), marked ``stop_gradient`` and outside the chunk optimizer
until it trains; then it becomes an fp32 chunk (the value paddle's master weight starts from) and joins.
"""
from __future__ import annotations


def wake(zopt) -> list:
    """Give every parameter trainable now its master chunk in the chunk optimizer; returns those woken."""
    if not zopt.held:
        return []
    r0 = zopt.held[0]
    woken = []
    for p in zopt.params:
        if p.stop_gradient:
            continue
        m = zopt.master[r0].get(id(p))
        if m is not None and not m.stop_gradient:
            continue
        woken.append(p)
        for r in zopt.held:
            m = zopt.master[r].get(id(p))
            if m is None:                               # stages 1/2: from the local data
                m = zopt._new_master(p, r)
            elif m.dtype != master_dtype(p):            # stage 3: the storage chunk in fp32 from now on
                m = zopt._new_master(p, r, m)
            m.stop_gradient = False
            _join(zopt, r, m, p)
    return woken


def master_dtype(p):
    import paddle

    return paddle.float64 if p.dtype == paddle.float64 else paddle.float32


def _join(zopt, r, m, p) -> None:
    """Add rank r's new master chunk ``m`` of ``p`` to its chunk optimizer; with parameter groups, to the group
    of the user's optimizer holding ``p`` (its learning-rate scale and weight decay)."""
    opt, user = zopt.inner_opts[r], zopt._inner._param_groups
    if not (user and isinstance(user[0], dict)):
        if opt._parameter_list is None:
            opt._parameter_list = []
        opt._param_groups = opt._parameter_list
        opt._parameter_list.append(m)
        return
    group = next((g for g in user if any(q is p for q in g["params"])), user[0])     # as optim_clone._grouped
    names = {q.name for q in group["params"]}
    for g in opt._param_groups:
        if any(zopt._names[r].get(c.name) in names for c in g["params"]):
            g["params"].append(m)
            return
    opt._add_param_group(dict({k: v for k, v in group.items() if k != "params"}, params=[m]))
