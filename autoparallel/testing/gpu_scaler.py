"""paddle.amp.GradScaler as it is built on a GPU, on a CPU machine (there paddle disables it: ``scale()``
returns the loss and ``step()`` just steps): the tracer's place reads as a GPU place while it is built."""
from __future__ import annotations

import paddle

from autoparallel import compat


def gpu_place():
    """Inside the block a new GradScaler sees a GPU place (and so stays enabled)."""
    return compat.gpu_place_for_grad_scaler()


def gpu_grad_scaler(**kwargs) -> paddle.amp.GradScaler:
    """``paddle.amp.GradScaler(**kwargs)`` built as on a GPU; raises RuntimeError if paddle still disabled it."""
    with gpu_place():
        scaler = paddle.amp.GradScaler(**kwargs)
    if not scaler._enable:
        raise RuntimeError(f"paddle.amp.GradScaler({kwargs}) stayed disabled under a GPU place")
    return scaler
