"""PaddleFormers' ``Trainer`` (plain mode) over a model parallelized here.

The Trainer accumulates the value ``training_step`` returns into a plain tensor and checks it with
``isinstance(loss, paddle.Tensor)``; a distributed model's loss is a DistTensor, so the first step failed
with a bare AssertionError. ``training_step`` here returns the loss's global value as a plain tensor (read
by every rank, as every rank runs the step); the backward inside it is unchanged. The Trainer's own
optimizer over the distributed parameters runs as ``ap.shard_optimizer`` would
(parallel/implicit_optimizer.py), and its ``model.no_sync()`` for gradient accumulation is this project's
(no_sync.py). On several launched ranks the Trainer wraps the model in ``paddle.DataParallel``, which is refused
(ddp_guard.py).

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
    patches.patch(cls, "training_step", _training_step(cls.training_step))


def _training_step(orig):
    def training_step(self, *args, **kwargs):
        from autoparallel.dist_tensor import is_dist

        loss = orig(self, *args, **kwargs)
        return loss.full().detach() if is_dist(loss) else loss

    training_step._ap_wrapper = True
    return training_step
