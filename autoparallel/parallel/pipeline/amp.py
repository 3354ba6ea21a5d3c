"""Mixed precision with pipeline parallelism (``strategy.amp``).

* autocast: ``apply_amp`` on the model's layers (emulated on CPU, parallel/amp.py), so every stage's forward
  runs its Linear layers (O1) or every parametrised leaf layer but the norms (O2) in the low-precision dtype;
* loss scaling (float16): the last stage multiplies each micro-batch's loss by the current scale before its
  backward (``train_batch`` still returns the unscaled loss); the optimizer step unscales every gradient,
  then decides overflow for the **whole pipeline**: each rank's inf/nan flag is added over every rank of the
  job (in one process, the simulated world included, every stage is checked here), so either every stage
  steps or none does, and every rank updates its scale the same way. bfloat16 runs with a static scale of 1
  (the overflow check still skips a step with a nan anywhere).
"""
from __future__ import annotations

import paddle

from autoparallel.parallel.amp import AmpOptimizer, LossScaler, apply_amp, found_inf

# grads_scaled_by after a backward through a loss the pipeline returned when called like the model (called.py):
# the user's own graph scaled the gradients (or not), so opt.step() and scaler.step(opt) both take them as given
USER_BACKWARD = ("backward", 1.0)


def scaled_by_scaler(pipe):
    """The (id(scaler), scale) record of a train_batch(scaler=...) whose gradients are still scaled, else None."""
    scaled = getattr(pipe, "grads_scaled_by", None)
    return None if scaled is USER_BACKWARD else scaled


def install(pipe, model, amp) -> None:
    """Autocast on ``model``'s layers and the loss scaler of ``strategy.amp`` on ``pipe``."""
    apply_amp(model, amp.dtype, amp.level)
    pipe.loss_scaler = LossScaler.from_strategy(amp)


def agreed_found_inf(pipe, params) -> bool:
    """Whether any gradient of any stage on any rank holds inf/nan (the same answer on every rank)."""
    local = found_inf(params)
    if pipe.ranks is None:                       # every stage in this process
        return local
    import paddle.distributed as dist

    t = paddle.to_tensor([1.0 if local else 0.0], dtype="float32")
    dist.all_reduce(t)
    return float(t.numpy()[0]) > 0


class PipelineAmpOptimizer(AmpOptimizer):
    """Unscale, agree on overflow over every stage, skip or step (the wrapped optimizer clips after unscaling)."""

    def __init__(self, optimizer, pipe):
        super().__init__(optimizer, pipe.loss_scaler, None, params=optimizer.parameters)
        self.__dict__["_pipe"] = pipe

    def _pending_scale(self) -> float:
        """Every backward of a train_batch (or a call) runs on the pipeline's own loss scale."""
        return self.scaler.scale_value

    def step(self) -> bool:
        self._unscale()
        return self._step_unless(agreed_found_inf(self._pipe, self.params))


def batch_loss_scale(pipe, scaler) -> float:
    """The scale a ``train_batch`` runs its backward on: the pipeline's own (``strategy.amp``), a GradScaler's, or 1.
    With a GradScaler the pipeline records it (``grads_scaled_by``) until the scaler unscales the gradients
    (parallel/amp_scaler.py), so a step that would use still-scaled or never-scaled gradients raises."""
    if scaler is None:
        if scaled_by_scaler(pipe) is not None:
            raise RuntimeError("train_batch without the GradScaler the previous batch's gradients were scaled by "
                               "(they accumulate into the same gradients): pass scaler= on every batch of a step")
        return pipe.loss_scaler.scale_value if pipe.loss_scaler is not None else 1.0
    if not isinstance(scaler, paddle.amp.AmpScaler):
        raise TypeError(f"train_batch scaler: expected a paddle.amp.GradScaler, got {type(scaler).__name__}")
    if pipe.loss_scaler is not None:
        raise ValueError("train_batch got a GradScaler, but strategy.amp already scales the pipeline's loss "
                         "(and its optimizer unscales it); use one of the two")
    if not scaler._enable:
        return 1.0
    pipe.grads_scaled_by = (id(scaler), float(scaler._scale))
    return float(scaler._scale)
