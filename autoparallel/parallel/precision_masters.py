"""``multi_precision`` under ZeRO. A ZeRO optimizer steps float32 master chunks of every parameter; paddle keeps a
float32 master of a float16/bfloat16 parameter only when the optimizer has ``multi_precision=True`` (set by the
user, or by ``paddle.amp.decorate(level="O2")`` with ``master_weight`` None/True). Without it paddle computes the
update in float32 from the low-precision value and stores it rounded to the parameter's dtype (its moments are
float32 either way), so an update below half a unit in the last place is lost. ``round_unmastered`` gives that
here: after the step the master chunk of such a parameter is rounded through the parameter's dtype, so the next
step starts from the value paddle's parameter holds."""
from __future__ import annotations

import paddle

LOW = (paddle.float16, paddle.bfloat16)


def keeps_masters(optimizer) -> bool:
    """Whether the paddle optimizer ``optimizer`` is (or an ap wrapper drives) keeps float32 masters of its
    low-precision parameters."""
    for _ in range(8):                      # wrappers keep the optimizer they drive in ``_inner`` / ``optimizer``
        if optimizer is None or hasattr(type(optimizer), "_create_accumulators"):
            break
        own = vars(optimizer) if hasattr(optimizer, "__dict__") else {}
        optimizer = own.get("_inner", own.get("optimizer"))
    return bool(getattr(optimizer, "_multi_precision", False))


def unmastered(params, optimizer) -> list:
    """The trainable low-precision parameters for which ``optimizer`` keeps no float32 master."""
    if keeps_masters(optimizer):
        return []
    return [p for p in params if p.dtype in LOW and not p.stop_gradient]


def round_unmastered(masters: dict, params, optimizer) -> None:
    """``masters``: {id(param): master chunk} of one rank; each chunk of an unmastered parameter rounded in place
    through the parameter's dtype."""
    with paddle.no_grad():
        for p in unmastered(params, optimizer):
            m = masters.get(id(p))
            if m is not None and m._is_initialized():
                m.set_value(m.astype(p.dtype).astype(m.dtype))
