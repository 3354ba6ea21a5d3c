"""A paddle optimizer of the same kind and hyperparameters as a given one, over other parameters
(ZeRO steps the chunks of the master weights with it). Gradient clipping is not copied: a chunk-wise
clip would be wrong; the ZeRO optimizer clips by the global norm itself (parallel/clip.py)."""
from __future__ import annotations

import weakref

import paddle

SUPPORTED = ("AdamW", "Adam", "SGD", "Momentum", "Adagrad", "RMSProp", "Adamax", "Adadelta", "NAdam", "RAdam",
             "Rprop", "ASGD")
# clone -> [index of the user's parameter group each of its groups came from] (empty groups are dropped)
GROUP_SOURCES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# Optimizers whose update of a parameter reads norms of the whole parameter (layer-wise trust ratios): on a
# shard or a ZeRO chunk they would use the piece's norm, so they run only where every rank holds whole copies.
WHOLE_TENSOR = ("Lamb",)


def whole_tensor_kind(opt):
    """The class name of a paddle optimizer whose update is not elementwise (see WHOLE_TENSOR), else None."""
    return next((k for k in WHOLE_TENSOR if isinstance(opt, getattr(paddle.optimizer, k))), None)


def clone_optimizer(opt, params, name_map: dict, whole: bool = False):
    """``name_map``: {chunk parameter name: original parameter name} for name-based hooks. ``whole``: the
    params are whole copies of the originals (not chunks), so a WHOLE_TENSOR optimizer may be cloned too."""
    lr = opt._learning_rate
    grouped = _grouped(opt, params, name_map)
    clone = _clone(opt, grouped, lr, name_map, whole)
    if grouped is not params:
        GROUP_SOURCES[clone] = [i for i, g in enumerate(grouped.sources) if g]
    return clone


def _clone(opt, params, lr, name_map, whole):
    kind = type(opt).__name__
    more = _clone_more(opt, params, lr, name_map, whole)
    if more is not None:
        return more
    if isinstance(opt, paddle.optimizer.AdamW):
        fun = opt._apply_decay_param_fun
        return paddle.optimizer.AdamW(
            learning_rate=lr, **_betas(opt), parameters=params, weight_decay=_ctor(opt, "weight_decay"),
            lr_ratio=_named_ratio(opt._lr_ratio, name_map),
            apply_decay_param_fun=None if fun is None else (lambda n: fun(name_map.get(n, n))),
            lazy_mode=_ctor(opt, "lazy_mode"), amsgrad=getattr(opt, "_amsgrad", False))
    if isinstance(opt, paddle.optimizer.Adam):
        return paddle.optimizer.Adam(learning_rate=lr, **_betas(opt), parameters=params,
                                     weight_decay=opt.regularization, lazy_mode=_ctor(opt, "lazy_mode"),
                                     amsgrad=getattr(opt, "_amsgrad", False))
    if isinstance(opt, paddle.optimizer.Momentum):
        return paddle.optimizer.Momentum(learning_rate=lr, momentum=_ctor(opt, "momentum"), parameters=params,
                                         use_nesterov=_ctor(opt, "use_nesterov"), weight_decay=_momentum_decay(opt),
                                         rescale_grad=_ctor(opt, "rescale_grad"))
    if isinstance(opt, paddle.optimizer.SGD):
        return paddle.optimizer.SGD(learning_rate=lr, parameters=params, weight_decay=opt.regularization)
    if whole_tensor_kind(opt) is not None:
        raise NotImplementedError(f"{kind} under ZeRO: its update of a parameter reads norms of the whole parameter "
                                  f"(the layer-wise trust ratio) and each rank steps a chunk, so it would use the "
                                  f"chunk's norm; use an elementwise optimizer (AdamW, Adam, ...) or no sharding stage")
    raise TypeError(f"sharded optimizer states (ZeRO, the simulated world) support the paddle optimizers "
                    f"{', '.join(SUPPORTED)}{' (and Lamb over whole parameters)' if not whole else ', Lamb'}; "
                    f"got {kind}")


def _momentum_decay(opt):
    """Momentum keeps an L2Decay in its fused op (``_regularization_method``), not in ``regularization``."""
    if _ctor(opt, "regularization_method") == "l2_decay":
        return paddle.regularizer.L2Decay(_ctor(opt, "regularization_coeff"))
    return opt.regularization


def _betas(opt) -> dict:
    return {k: _ctor(opt, k) for k in ("beta1", "beta2", "epsilon")}


def _ctor(opt, key: str, attr: str | None = None):
    """The constructor's ``key`` of ``opt``. paddle's step over parameter groups sets ``opt._beta1``,
    ``opt._exclude_from_weight_decay_fn`` ... to each group's value in turn and leaves the last group's there; a
    clone built from those would give that group's settings to every group without its own. ``_default_dict``
    keeps the constructor's values."""
    d = getattr(opt, "_default_dict", None) or {}
    return d[key] if key in d else getattr(opt, attr or "_" + key, "" if "regularization" in key else None)


class _Groups(list):
    """Parameter groups of a clone; ``sources``: one flag per group of the user's optimizer (kept or empty)."""
    sources: list = []


def _grouped(opt, params, name_map):
    """``params`` in the parameter groups of ``opt`` (each group's own learning-rate scale, weight decay...),
    a parameter found by its original's name; the flat list when ``opt`` has no groups. A group's
    ``grad_clip`` is not copied: the ap optimizers clip (ZeRO chunks: sharding.py) or set the clone's clips
    at each step (the simulated world: sim_step.py)."""
    groups = getattr(opt, "_param_groups", None)
    if not groups or not isinstance(groups[0], dict):
        return params
    where = {p.name: i for i, g in enumerate(groups) for p in g["params"]}
    out = [dict({k: v for k, v in g.items() if k not in ("params", "grad_clip")}, params=[], grad_clip=None,
                **_group_decay(g), **_group_hooks(g, name_map)) for g in groups]
    for p in params:
        out[where.get(name_map.get(p.name, p.name), 0)]["params"].append(p)
    kept = _Groups(g for g in out if g["params"])
    kept.sources = [bool(g["params"]) for g in out]
    return kept


def _group_decay(g) -> dict:
    """Momentum turns a group's L2 ``weight_decay`` into ``regularization_method`` / ``_coeff`` and sets the
    group's ``weight_decay`` to None; a clone's constructor reads ``weight_decay`` again (None: no decay), so the
    L2 decay is given back to it as an L2Decay (the group's decay was dropped on every rank's copy and chunk)."""
    if g.get("regularization_method") == "l2_decay" and g.get("weight_decay") is None:
        return {"weight_decay": paddle.regularizer.L2Decay(g.get("regularization_coeff", 0.0))}
    return {}


def _group_hooks(g, name_map) -> dict:
    """A group's own name-based hook (Lamb's ``exclude_from_weight_decay_fn``) sees a chunk or a rank's copy under
    its original's name, as the constructor's does."""
    fun = g.get("exclude_from_weight_decay_fn")
    return {} if fun is None else {"exclude_from_weight_decay_fn":
                                   lambda p: fun(_NamedAs(p, name_map.get(p.name, p.name)))}


def copy_group_clips(inner, clone) -> None:
    """Each group of ``clone`` takes the ``grad_clip`` the user's group it came from has now."""
    for g, i in zip(clone._param_groups, GROUP_SOURCES.get(clone, ())):
        g["grad_clip"] = inner._param_groups[i].get("grad_clip")


def _named_ratio(fun, name_map):
    """AdamW's ``lr_ratio(param)`` sees a chunk or a rank's copy under its original's name."""
    return None if fun is None else (lambda p: fun(_NamedAs(p, name_map.get(p.name, p.name))))


def sync_lr(inner, clone) -> None:
    """A learning rate set on the user's optimizer (``set_lr``) or a scheduler it was given
    (``set_lr_scheduler``) reaches its clone (a scheduler object is shared, so its steps are too)."""
    from paddle.optimizer.lr import LRScheduler

    lr = inner._learning_rate
    if isinstance(lr, LRScheduler):
        if clone._learning_rate is not lr:
            clone.set_lr_scheduler(lr)
    elif clone._learning_rate != lr:          # (paddle itself never goes from a scheduler back to a number)
        clone.set_lr(lr)


def _clone_more(opt, params, lr, name_map, whole):
    """The elementwise optimizers besides AdamW/Adam/SGD/Momentum; Lamb over whole parameters."""
    O, wd = paddle.optimizer, opt.regularization
    if isinstance(opt, O.Adagrad):
        return O.Adagrad(lr, epsilon=_ctor(opt, "epsilon"), parameters=params, weight_decay=wd,
                         initial_accumulator_value=_ctor(opt, "initial_accumulator_value", "initial_accumulator_value"))
    if isinstance(opt, O.RMSProp):
        return O.RMSProp(lr, rho=_ctor(opt, "rho"), epsilon=_ctor(opt, "epsilon"), momentum=_ctor(opt, "momentum"),
                         centered=_ctor(opt, "centered"), parameters=params, weight_decay=wd)
    if isinstance(opt, O.Adamax):
        return O.Adamax(lr, **_betas(opt), parameters=params, weight_decay=wd)
    if isinstance(opt, O.Adadelta):
        return O.Adadelta(lr, epsilon=_ctor(opt, "epsilon"), rho=_ctor(opt, "rho"), parameters=params, weight_decay=wd)
    if isinstance(opt, O.NAdam):
        return O.NAdam(lr, **_betas(opt), momentum_decay=_ctor(opt, "momentum_decay"), parameters=params,
                       weight_decay=wd)
    if isinstance(opt, O.RAdam):
        return O.RAdam(lr, **_betas(opt), parameters=params, weight_decay=wd)
    if isinstance(opt, O.Rprop):
        rng, etas = opt._learning_rate_range, opt._etas
        return O.Rprop(lr, learning_rate_range=tuple(float(v) for v in _values(rng)), parameters=params,
                       etas=tuple(float(v) for v in _values(etas)))
    if isinstance(opt, O.ASGD):
        return O.ASGD(lr, batch_num=opt._n, parameters=params, weight_decay=wd)
    if isinstance(opt, O.Lamb) and whole:
        fun = _ctor(opt, "exclude_from_weight_decay_fn")
        return O.Lamb(lr, lamb_weight_decay=_ctor(opt, "lamb_weight_decay"), **_betas(opt), parameters=params,
                      exclude_from_weight_decay_fn=None if fun is None else
                      (lambda p: fun(_NamedAs(p, name_map.get(p.name, p.name)))),
                      always_adapt=getattr(opt, "always_adapt", False))
    return None


def _values(v):
    return v.numpy().reshape(-1).tolist() if hasattr(v, "numpy") else list(v[0] if len(v) == 1 else v)


class _NamedAs:
    """A parameter seen by a name-based hook under its original's name."""

    def __init__(self, p, name):
        self._p, self.name = p, name

    def __getattr__(self, attr):
        return getattr(self._p, attr)


def state_tensors(opt) -> list:
    """Live optimizer-state tensors (moments, beta powers, master weights) of a paddle optimizer."""
    out = [t for acc in opt._accumulators.values() for t in acc.values()]
    return out + list(getattr(opt, "_master_weights", {}).values())
