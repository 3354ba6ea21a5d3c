"""``ReduceOnPlateau.step(loss)`` with a distributed loss: paddle's scheduler accepts numbers, numpy arrays and
paddle Tensors only; a DistTensor metric is read as its global value (``float``: a collective every rank
runs, as every rank steps its scheduler), so every rank lowers the learning rate at the same step."""
from __future__ import annotations

from autoparallel.dist_tensor import is_dist


def _step(orig):
    def step(self, metrics=None, epoch=None):
        if is_dist(metrics):
            metrics = float(metrics)
        return orig(self, metrics, epoch)
    step._ap_wrapper = True
    return step


def install() -> None:
    """Patch ``paddle.optimizer.lr.ReduceOnPlateau.step`` (ledger: undone by ``ap.uninstall()``)."""
    import paddle

    from autoparallel import patches

    cls = paddle.optimizer.lr.ReduceOnPlateau
    own = cls.__dict__["step"]
    if not getattr(own, "_ap_wrapper", False):
        patches.patch(cls, "step", _step(own))
