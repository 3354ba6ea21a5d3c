"""``Layer.sharded_state_dict`` over distributed parameters: each one enters as its full (global) value.

paddle's flex-checkpoint (``Layer.sharded_state_dict`` / ``Layer.full``, which PaddleFormers'
``save_pretrained`` uses) describes every tensor of ``state_dict()`` by its ``.shape``. A DistParameter's
``.shape`` is its local shard's, so without this hook a tensor-parallel weight would be described, and saved,
as a complete weight of half its size. The hook hands paddle the gathered global value instead (a replicated
ShardedWeight): every rank calls it in the same order, as it does for the rest of ``save_pretrained``.
"""
from __future__ import annotations

from autoparallel import patches

_INSTALLED = [False]


def _full_values(state_dict: dict) -> dict:
    from autoparallel.dist_tensor import is_dist

    return {k: (_plain(v.full()) if is_dist(v) else v) for k, v in state_dict.items()}


def _plain(t):
    """A plain tensor of the global value (a replicated parameter's ``full()`` is the parameter itself)."""
    import paddle

    from autoparallel.dist_tensor import is_dist

    return paddle.to_tensor(t.numpy()) if is_dist(t) else t.detach()


def install() -> None:
    if _INSTALLED[0]:
        return
    from paddle.nn.layer import layers

    orig = layers.build_sharded_state_dict

    def build_sharded_state_dict(state_dict, shard_rules=None, prefix=""):
        return orig(_full_values(state_dict), shard_rules, prefix)

    patches.patch(layers, "build_sharded_state_dict", build_sharded_state_dict)
    _INSTALLED[0] = True


def _reset() -> None:
    _INSTALLED[0] = False


patches.on_undo(_reset)
