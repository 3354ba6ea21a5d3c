"""A paddle optimizer of the same kind and hyperparameters as a given one, over other parameters
(ZeRO steps the chunks of the master weights with it). Gradient clipping is not copied: a chunk-wise
clip would be wrong; the ZeRO optimizer clips by the global norm itself (parallel/clip.py)."""
from __future__ import annotations

import paddle

SUPPORTED = ("AdamW", "Adam", "SGD", "Momentum")


def clone_optimizer(opt, params, name_map: dict):
    """``name_map``: {chunk parameter name: original parameter name} for name-based hooks."""
    kind = type(opt).__name__
    lr = opt._learning_rate
    if isinstance(opt, paddle.optimizer.AdamW):
        fun = opt._apply_decay_param_fun
        return paddle.optimizer.AdamW(
            learning_rate=lr, beta1=opt._beta1, beta2=opt._beta2, epsilon=opt._epsilon, parameters=params,
            weight_decay=opt._weight_decay, lr_ratio=opt._lr_ratio,
            apply_decay_param_fun=None if fun is None else (lambda n: fun(name_map.get(n, n))),
            lazy_mode=opt._lazy_mode, amsgrad=getattr(opt, "_amsgrad", False))
    if isinstance(opt, paddle.optimizer.Adam):
        return paddle.optimizer.Adam(learning_rate=lr, beta1=opt._beta1, beta2=opt._beta2, epsilon=opt._epsilon,
                                     parameters=params, weight_decay=opt.regularization, lazy_mode=opt._lazy_mode,
                                     amsgrad=getattr(opt, "_amsgrad", False))
    if isinstance(opt, paddle.optimizer.Momentum):
        return paddle.optimizer.Momentum(learning_rate=lr, momentum=opt._momentum, parameters=params,
                                         use_nesterov=opt._use_nesterov, weight_decay=opt.regularization,
                                         rescale_grad=opt._rescale_grad)
    if isinstance(opt, paddle.optimizer.SGD):
        return paddle.optimizer.SGD(learning_rate=lr, parameters=params, weight_decay=opt.regularization)
    raise TypeError(f"sharded optimizer states (ZeRO, the simulated world) support the paddle optimizers "
                    f"{', '.join(SUPPORTED)}; got {kind}")


def state_tensors(opt) -> list:
    """Live optimizer-state tensors (moments, beta powers, master weights) of a paddle optimizer."""
    out = [t for acc in opt._accumulators.values() for t in acc.values()]
    return out + list(getattr(opt, "_master_weights", {}).values())
