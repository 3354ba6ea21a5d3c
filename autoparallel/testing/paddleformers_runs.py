"""Runs of PaddleFormers models under ``ap.parallelize`` (dp=2, tp=2, default plans), in the simulated world
or on 4 real ranks: one backward (loss and every gradient) or a few AdamW steps (losses and final parameters),
compared with one process. Builders and the DP / seed-shard-function runs: autoparallel.testing.paddleformers_models."""
from __future__ import annotations

import numpy as np

from autoparallel.testing import paddleformers_models as pf


def strategy(dp=2, tp=2, sp=False):
    import autoparallel as ap

    s = ap.Strategy()
    s.data_parallel.degree = dp
    s.tensor_parallel.degree = tp
    s.sequence_parallel.enable = sp
    return s


def parallelized(name: str, seed: int = 0, lr: float = 1e-3, tp_plan=None, sp: bool = False, **overrides):
    """(model, optimizer) after ``ap.parallelize`` with the default plans, after checking the ties and that
    the optimizer holds every parameter of the model once."""
    import paddle

    import autoparallel as ap

    model = pf.build(name, seed, **overrides)
    ties = _ties(model)
    opt = paddle.optimizer.AdamW(lr, parameters=model.parameters())
    model, opt = ap.parallelize(model, opt, strategy=strategy(sp=sp), tp_plan=tp_plan)
    for a, b in ties:
        if _get(model, a) is not _get(model, b):
            raise AssertionError(f"tie {a} = {b} split by parallelize")
    mine = {id(p) for p in model.parameters()}
    held = [id(p) for p in opt._inner._parameter_list]
    if len(held) != len(set(held)) or set(held) != mine:
        raise AssertionError(f"optimizer holds {len(held)} entries ({len(set(held))} distinct), model has {len(mine)}")
    return model, opt


def _ties(model) -> list:
    """[(path a, path b)] of parameter slots holding the same Parameter object."""
    first, out = {}, []
    for name, layer in model.named_sublayers(include_self=True):
        for attr, p in layer._parameters.items():
            if p is None:
                continue
            path = f"{name}.{attr}" if name else attr
            if id(p) in first:
                out.append((first[id(p)], path))
            else:
                first[id(p)] = path
    return out


def _get(model, path):
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def parallelize_grads(name: str, seed: int = 0, sp: bool = False, **overrides):
    """One backward under parallelize: (loss, {name: full gradient}), plain tensors passed by keyword."""
    import paddle

    model, opt = parallelized(name, seed, sp=sp, **overrides)
    ids, labels = pf.batch(seed)
    loss = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
    loss.backward()
    opt.reduce_gradients()
    return float(loss), {n: pf._grad_np(p) for n, p in model.named_parameters()}


def train(name: str, steps: int = 5, seed: int = 0, distributed: bool = True, lr: float = 1e-3):
    """``steps`` AdamW steps on a fixed batch: (losses, {name: final full parameter}). AdamW divides each
    element's update by its gradient's magnitude, so float-order noise in a near-zero gradient moves that
    element by up to ~lr; the default lr keeps that inside the comparison's atol."""
    import paddle

    if distributed:
        model, opt = parallelized(name, seed, lr=lr)
    else:
        model = pf.build(name, seed)
        opt = paddle.optimizer.AdamW(lr, parameters=model.parameters())
    ids, labels = pf.batch(seed)
    losses = []
    for _ in range(steps):
        loss = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    final = {n: (p.full().numpy() if hasattr(p, "full") else p.numpy()) for n, p in model.named_parameters()}
    return losses, final


def worst_rel(ref: dict, got: dict) -> float:
    """max over tensors of max|got - ref| / max|ref| (the README table's figure)."""
    return max(float(np.abs(got[n] - r).max() / (np.abs(r).max() + 1e-12)) for n, r in ref.items())
