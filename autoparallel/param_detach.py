"""``detach()`` of a distributed parameter: this rank's shard (a parameter's storage methods act on the shard,
DESIGN "Shapes"), noted so that a routed op reading it next to distributed tensors takes the parameter's global
value (dispatch._to_dist, dispatch_cache._plain_locals)."""
from __future__ import annotations

import weakref

from autoparallel.compat import EagerParamBase, SideData

DETACHED_SHARDS = SideData()    # p.detach() of a distributed parameter -> weak reference to p


def param_detach(self):
    """paddle's ``detach()``: this rank's shard without a gradient (storage methods act on the shard, DESIGN
    "Shapes"). Next to distributed tensors in a routed op it stands for the parameter's global value
    (``x @ p.detach()`` equals one process), not for a replicated tensor of the shard's shape."""
    out = EagerParamBase.detach(self)
    if hasattr(self, "_ap_spec"):
        DETACHED_SHARDS.set(out, weakref.ref(self))
    return out


def detached_param(v):
    """The distributed parameter ``v`` is the ``detach()`` of (None for any other tensor)."""
    ref = DETACHED_SHARDS.get(v)
    p = ref() if ref is not None else None
    return p if p is not None and hasattr(p, "_ap_spec") else None
