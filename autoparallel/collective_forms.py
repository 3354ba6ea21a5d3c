"""The user's own ``paddle.distributed`` collectives on a distributed tensor (a metric summed over ranks).

Code written for one process per data shard sums a metric over ranks: ``dist.all_reduce(correct)``, or gathers
predictions: ``dist.all_gather(parts, preds)``. A tensor autoparallel computed (the model's outputs, a loss, a
count over them) already holds the value over the whole global batch on every rank, so a sum over ranks would
count every sample once per rank. paddle's collectives failed on it with ``argument (position 1) must be Tensor,
but got DistTensor``; they now raise a TypeError that says so and what to write: read the value as it is
(``float(t)``, ``t.numpy()``). Plain tensors and parameters pass through unchanged."""
from __future__ import annotations

from autoparallel import patches

NAMES = {"all_reduce": 0, "reduce": 0, "all_gather": 1, "all_gather_object": None}
_INSTALLED = [False]


def _refuse(name: str, t) -> None:
    from autoparallel.placement import Shard

    rows = any(isinstance(p, Shard) for p in t.placements)
    raise TypeError(f"paddle.distributed.{name} on a distributed tensor (layout {[str(p) for p in t.placements]}, "
                    f"global shape {list(t.spec.shape)}): its value is already the whole global batch's on every "
                    f"rank, so reducing or gathering it over ranks would count each sample once per rank; use the "
                    f"value as it is (float(t), t.numpy())"
                    + ("; ap.dtensor_to_local(t) is this rank's shard of it" if rows else ""))


def _guarded(name: str, index, orig):
    @patches.pass_through
    def wrapper(*args, **kwargs):
        from autoparallel.dist_tensor import DistTensor

        t = kwargs.get("tensor", args[index] if index is not None and len(args) > index else None)
        if index is None:
            t = kwargs.get("obj", args[1] if len(args) > 1 else None)
        if isinstance(t, DistTensor):          # a value computed from the model (a parameter passes as paddle's)
            _refuse(name, t)
        return orig(*args, **kwargs)

    wrapper._ap_wrapper = True
    wrapper.__wrapped__ = orig
    wrapper.__name__ = getattr(orig, "__name__", name)
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    return wrapper


def install() -> None:
    if _INSTALLED[0]:
        return
    import paddle.distributed as dist

    for name, index in NAMES.items():
        orig = getattr(dist, name, None)
        if orig is not None and not getattr(orig, "_ap_wrapper", False):
            patches.patch(dist, name, _guarded(name, index, orig))
    _INSTALLED[0] = True


def _reset() -> None:
    _INSTALLED[0] = False


patches.on_undo(_reset)
