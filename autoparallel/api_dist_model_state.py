"""``DistModel.set_state_dict``: global values copied into live tensors, each in its own layout."""
from __future__ import annotations

import numpy as np

__all__ = ["assign_all"]


def assign_all(pairs: dict) -> None:
    """``pairs``: {name: (live target, new value)}. Every value is checked before anything is written."""
    arrays = {name: _global_array(name, target, value) for name, (target, value) in pairs.items()
              if value is not target}
    import paddle

    from autoparallel.local_mode import local_mode

    with paddle.no_grad(), local_mode():
        for name, arr in arrays.items():
            _write(pairs[name][0], arr)


def _global_array(name, target, value) -> np.ndarray:
    import paddle

    from autoparallel.dist_tensor import DistTensor, is_dist

    if not isinstance(target, (paddle.Tensor, DistTensor)):
        raise NotImplementedError(f"set_state_dict[{name!r}]: this entry is a {type(target).__name__} (held in "
                                  f"chunks by the ZeRO optimizer); restore ZeRO runs with ap.save_state_dict / "
                                  f"ap.load_state_dict on dist_model.state_dict('all')")
    if is_dist(value):
        arr = value.full().numpy()
    elif isinstance(value, paddle.Tensor):
        arr = value.numpy()
    elif isinstance(value, np.ndarray):
        arr = value
    else:
        raise TypeError(f"set_state_dict[{name!r}]: expected a tensor or numpy array, got {type(value).__name__}")
    want = list(target.global_shape) if is_dist(target) else list(target.shape)
    if list(arr.shape) != want:
        raise ValueError(f"set_state_dict[{name!r}]: expected global shape {want}, got {list(arr.shape)}")
    return arr


def _write(target, arr: np.ndarray) -> None:
    import paddle

    from autoparallel.dist_tensor import is_dist, shard_tensor

    src = paddle.to_tensor(arr).cast(target.dtype)
    if not is_dist(target):
        paddle.assign(src, output=target)
        return
    placed = shard_tensor(src, target.mesh, list(target.placements))
    for rank, local in target.locals.items():
        paddle.assign(placed.locals[rank], output=local)
