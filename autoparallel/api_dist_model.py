"""paddle's ``DistModel`` call form on ``ap.to_static``'s DistModel: a mode, then calls.

    dist_model = ap.to_static(model, loader, loss, optimizer, strategy)
    dist_model.train()
    for x, y in loader:
        loss = dist_model(x, y)          # one optimizer step (train_step); the mean global loss, a 0-d tensor
    dist_model.eval();    loss = dist_model(x, y)       # eval_step: the loss, nothing updated
    dist_model.predict(); out = dist_model(x)           # the model's output (a DistTensor)

``predict(inputs)`` with an argument keeps this project's direct form (the output for ``inputs``).
"""
from __future__ import annotations

__all__ = ["PaddleModes", "state_dict_mode"]

_UNSET = object()
MODES = ("train", "eval", "predict")


class PaddleModes:
    """Mixin: ``train()`` / ``eval()`` / ``predict()`` choose what ``__call__`` runs (paddle's default: train)."""

    _mode = "train"

    def train(self) -> None:
        self._mode = "train"

    def eval(self) -> None:
        self._mode = "eval"

    def predict(self, inputs=_UNSET):
        if inputs is _UNSET:
            self._mode = "predict"
            return None
        return self._predict(inputs)

    @property
    def mode(self) -> str:
        return self._mode

    def __call__(self, *fields):
        import paddle

        if not fields:
            raise TypeError(f"DistModel({self._mode} mode) expects the batch fields: dist_model(inputs..., label)"
                            f"{'' if self._mode != 'predict' else ' or, in predict mode, dist_model(inputs...)'}")
        if self._mode == "predict":
            return self._predict(fields)
        step = self.train_step if self._mode == "train" else self.eval_step
        return paddle.to_tensor(step(tuple(fields)), dtype="float32")


def state_dict_mode(full, split_fusion=True) -> bool:
    """``DistModel.state_dict``'s first argument: this project's ``full`` (bool) or paddle's ``mode``: "param" (the
    parameters, as ``full=False``) is honoured; "opt" and "all" (optimizer states) are refused, naming where
    optimizer states are; ``split_fusion`` must stay True (no fused parameters here)."""
    if split_fusion is not True:
        raise NotImplementedError(f"DistModel.state_dict(split_fusion={split_fusion!r}): parameters are never fused "
                                  f"here; only split_fusion=True is accepted")
    if isinstance(full, bool):
        return full
    if full == "param":
        return False
    if full in ("opt", "all"):
        raise NotImplementedError(f"DistModel.state_dict(mode={full!r}): optimizer states are not in the model's "
                                  f"state dict here; take them from dist_model.optimizer.state_dict(), or save both "
                                  f"with ap.save_state_dict")
    raise TypeError(f"DistModel.state_dict expects full=True/False or paddle's mode 'param', got {full!r}")
