"""paddle's initializers called on a distributed parameter (``nn.initializer.Constant(2.0)(layer.weight)``,
``XavierNormal()(p)`` after ``shard_layer``): the initializer fills a tensor of the GLOBAL shape (fan-in and
fan-out read from it, as in one process), then every held shard takes its part (``set_value``). Without this
it filled only the parameter's own storage: one shard, the other ranks' copies in the simulated world kept
their values."""
from __future__ import annotations

import paddle

from autoparallel import patches
from autoparallel.compat import EagerParamBase
from autoparallel.local_mode import local_mode


def install() -> None:
    from paddle.nn.initializer.initializer import Initializer

    orig = Initializer.__call__
    if getattr(orig, "_ap_wrapper", False):
        return

    def __call__(self, param, block=None):
        if not hasattr(param, "_ap_spec") or _lazy():
            return orig(self, param, block)
        with local_mode(), paddle.no_grad():
            full = EagerParamBase.from_tensor(paddle.zeros(param.global_shape, dtype=param.dtype))
            orig(self, full, block)
        param.set_value(full.detach())
        return None

    __call__._ap_wrapper = True
    __call__.__wrapped__ = orig
    patches.patch(Initializer, "__call__", __call__)


def _lazy() -> bool:
    from paddle.nn.initializer.lazy_init import lazy_init_helper

    return bool(lazy_init_helper().state)
