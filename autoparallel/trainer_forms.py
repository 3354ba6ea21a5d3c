"""PaddleFormers' ``Trainer`` (plain mode) over a model parallelized here.

The Trainer accumulates the value ``training_step`` returns into a plain tensor and checks it with
``isinstance(loss, paddle.Tensor)``; a distributed model's loss is a DistTensor, so the first step failed
with a bare AssertionError. ``training_step`` here returns the loss's global value as a plain tensor (read
by every rank, as every rank runs the step); the backward inside it is unchanged. The Trainer's own
optimizer over the distributed parameters runs as ``ap.shard_optimizer`` would
(parallel/implicit_optimizer.py), and its ``model.no_sync()`` for gradient accumulation is this project's
(no_sync.py). On several launched ranks the Trainer sets up its own data parallelism (fleet's hybrid-parallel groups, then
``paddle.DataParallel``) over the model: refused when the Trainer is built, naming the conflict (without this
module installed, ``paddle.DataParallel`` is refused by ddp_guard.py, or fleet fails first).

With ``gradient_accumulation_steps > 1`` the Trainer divides every ``p.grad`` by that number by hand before the
optimizer step. In the simulated world ``p.grad`` of a distributed parameter is the lowest rank's copy only, so
``optimizer_step`` here applies the same division to the other ranks' copies first (a real rank holds one copy).

With ``recompute_granularity`` set (or expert parallelism) the Trainer runs every backward under ``no_sync`` and
then all-reduces the parameters' gradients itself (paddle's ``fused_allreduce_gradients``, which reads the local
shards and needs paddle's global group). Distributed parameters are left out of that call: their reduction is
the optimizer's (from backward hooks, or at its step for what ``no_sync`` kept), exactly once.

Installed with dispatch when ``paddleformers.trainer.trainer`` is already imported; else at the Trainer's
first ``hasattr(model, "no_sync")`` (it asks before every training step; no_sync.py calls ``install()``, a
dictionary look-up once installed).
"""
from __future__ import annotations

import sys

from autoparallel import patches


def install() -> None:
    mod = sys.modules.get("paddleformers.trainer.trainer")
    cls = getattr(mod, "Trainer", None)
    if cls is None or getattr(cls.__dict__.get("training_step"), "_ap_wrapper", False):
        return
    patches.patch(cls, "__init__", _init(cls.__init__))
    patches.patch(cls, "training_step", _training_step(cls.training_step))
    patches.patch(cls, "optimizer_step", _optimizer_step(cls.optimizer_step))
    if callable(getattr(mod, "fused_allreduce_gradients", None)):
        patches.patch(mod, "fused_allreduce_gradients", _fused_allreduce(mod.fused_allreduce_gradients))


def _training_step(orig):
    def training_step(self, *args, **kwargs):
        from autoparallel.dist_tensor import is_dist

        loss = orig(self, *args, **kwargs)
        return loss.full().detach() if is_dist(loss) else loss

    training_step._ap_wrapper = True
    return training_step


def _optimizer_step(orig):
    def optimizer_step(self, *args, **kwargs):
        k = self.args.gradient_accumulation_steps
        if k > 1 and not self.args.enable_auto_parallel:
            _scale_other_copies(self.model, 1.0 / k)
        return orig(self, *args, **kwargs)

    optimizer_step._ap_wrapper = True
    return optimizer_step


def _scale_other_copies(model, factor: float) -> None:
    """The simulated world: what the Trainer did to each distributed parameter's ``p.grad`` (the lowest rank's
    copy), done to the other ranks' copies."""
    import paddle

    from autoparallel.comm.world import current_world
    from autoparallel.dist_tensor import is_dist
    from autoparallel.local_mode import local_mode

    if not current_world().is_simulated:
        return
    with local_mode(), paddle.no_grad():
        for p in model.parameters():
            if not is_dist(p) or p.grad is None:
                continue
            seen = {p.grad.data_ptr()}              # a copy sharing the lowest rank's gradient is done already
            for t in p.locals.values():
                g = t.grad
                if t is not p and g is not None and g._is_initialized() and g.data_ptr() not in seen:
                    seen.add(g.data_ptr())
                    g.scale_(factor)


def _fused_allreduce(orig):
    def fused_allreduce_gradients(parameter_list, hcg, *args, **kwargs):
        from autoparallel.dist_tensor import is_dist

        params = list(parameter_list)
        plain = [p for p in params if not is_dist(p)]
        if len(plain) == len(params):
            return orig(params, hcg, *args, **kwargs)
        if plain:
            return orig(plain, hcg, *args, **kwargs)
        return None

    fused_allreduce_gradients._ap_wrapper = True
    return fused_allreduce_gradients


def _init(orig):
    import inspect

    sig = inspect.signature(orig)

    def __init__(self, *args, **kwargs):
        from autoparallel.dist_tensor import is_dist

        bound = sig.bind_partial(self, *args, **kwargs).arguments
        model, targs = bound.get("model"), bound.get("args")
        world = getattr(targs, "world_size", 1) if targs is not None else 1
        if world > 1 and model is not None and any(is_dist(p) for p in model.parameters()):
            raise NotImplementedError(
                f"PaddleFormers' Trainer on {world} launched ranks sets up its own data parallelism (fleet's "
                f"hybrid-parallel groups, paddle.DataParallel) over {type(model).__name__}, whose parameters are "
                f"already distributed by autoparallel (its gradients would be reduced twice); run the Trainer in one "
                f"process (ap.simulate for the distributed layout) or write the training loop over the model")
        return orig(self, *args, **kwargs)

    __init__._ap_wrapper = True
    return __init__
