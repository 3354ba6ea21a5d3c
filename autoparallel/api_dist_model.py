"""paddle's ``DistModel`` call form on ``ap.to_static``'s DistModel: a mode, then calls.

    dist_model = ap.to_static(model, loader, loss, optimizer, strategy)
    dist_model.train()
    for x, y in loader:
        loss = dist_model(x, y)          # one optimizer step (train_step); the mean global loss, a 0-d ndarray
    dist_model.eval();    loss = dist_model(x, y)       # eval_step: the loss, nothing updated
    dist_model.predict(); out = dist_model(x)           # the model's output (a DistTensor)

``predict(inputs)`` with an argument keeps this project's direct form (the output for ``inputs``). The first mode
is paddle's: "train" with a loss and an optimizer, "eval" with a loss only, "predict" with neither. A call takes
the fields as arguments or as one list / tuple of them (``dist_model([x, y])``), as paddle's does.

    sd = dist_model.state_dict("all")     # parameters and buffers, and optimizer states named "<param>.<state>"
    dist_model.set_state_dict(sd)         # values copied into the live tensors, each in its own layout
"""
from __future__ import annotations

__all__ = ["PaddleModes", "state_dict_mode", "StateDictForms"]

_UNSET = object()
MODES = ("train", "eval", "predict")


class PaddleModes:
    """Mixin: ``train()`` / ``eval()`` / ``predict()`` choose what ``__call__`` runs (first mode: paddle's, see above)."""

    def train(self) -> None:
        self._chosen_mode = "train"

    def eval(self) -> None:
        self._chosen_mode = "eval"

    def predict(self, inputs=_UNSET):
        if inputs is _UNSET:
            self._chosen_mode = "predict"
            return None
        return self._predict(inputs)

    @property
    def mode(self) -> str:
        chosen = self.__dict__.get("_chosen_mode")
        if chosen is not None:
            return chosen
        if self.loss_fn is not None:                 # paddle's first mode
            return "train" if self.optimizer is not None else "eval"
        return "predict"

    def __call__(self, *fields):
        import numpy as np

        fields, mode = _flatten(fields), self.mode
        if not fields:
            raise TypeError(f"DistModel({mode} mode) expects the batch fields: dist_model(inputs..., label)"
                            f"{'' if mode != 'predict' else ' or, in predict mode, dist_model(inputs...)'}")
        if mode == "predict":
            return self._predict(fields)
        step = self.train_step if mode == "train" else self.eval_step
        # paddle's loss is fetched with Strategy.return_numpy (its default True, the only value taken here): a
        # float32 numpy array, 0-d for a mean loss
        return np.asarray(step(tuple(fields)), dtype="float32")


def _flatten(args) -> tuple:
    """paddle's ``DistModel(*args)``: a list / tuple argument holds batch fields; a dict is refused."""
    out = []
    for a in args:
        if isinstance(a, dict):
            raise TypeError(f"DistModel takes the batch fields as tensors or lists of tensors, got a dict with keys "
                            f"{sorted(a)[:6]}; pass the fields in order: dist_model(inputs..., label), e.g. "
                            f"dist_model(list(batch.values())) for a loader's dict batch (paddle's field order)")
        if isinstance(a, (list, tuple)) and not any(isinstance(i, (list, tuple, dict)) for i in a):
            out.extend(a)
        else:
            out.append(a)
    return tuple(out)


def state_dict_mode(full, split_fusion=True):
    """``DistModel.state_dict``'s first argument: this project's ``full`` (bool: gathered numpy values or not) or
    paddle's ``mode``: "param" (as ``full=False``), "opt" or "all" (returned as is); ``split_fusion`` must stay
    True (no fused parameters here)."""
    if split_fusion is not True:
        raise NotImplementedError(f"DistModel.state_dict(split_fusion={split_fusion!r}): parameters are never fused "
                                  f"here; only split_fusion=True is accepted")
    if isinstance(full, bool):
        return full
    if full == "param":
        return False
    if full in ("opt", "all"):
        return full
    raise TypeError(f"DistModel.state_dict expects full=True/False or paddle's mode 'param', 'opt' or 'all', got "
                    f"{full!r}")


class StateDictForms:
    """Mixin: paddle's ``state_dict("opt" / "all")``, ``set_state_dict`` and the program accessors of DistModel."""

    def _training_state(self) -> dict:
        """ap.training_state of the model and optimizer ({"model": ..., "optimizer": {param: {state: ...}}})."""
        if self.optimizer is None:
            raise ValueError("DistModel.state_dict('opt'/'all'): this DistModel has no optimizer (ap.to_static was "
                             "given optimizer=None); use state_dict('param')")
        from autoparallel.checkpoint.state import training_state

        try:
            return training_state(self.network, self.optimizer)
        except TypeError as e:
            raise TypeError(f"DistModel.state_dict('opt'/'all') reads the states of a paddle optimizer: {e}") from None

    def _param_entries(self, state=None) -> dict:
        """The model's parameters and buffers; under ZeRO the optimizer's checkpoint leaves replace the
        parameters it shards (their live tensors hold no data between steps at stage 3, and at every stage a
        load must also reach the optimizer's master chunks), so saving and loading this dict round-trips."""
        sd = dict(self.network.state_dict())
        if state is None and self.optimizer is not None and callable(getattr(self.optimizer, "checkpoint_state",
                                                                             None)):
            state = self._training_state()
        if state is not None:
            sd.update(state.get("model", {}))
        return sd

    def _paddle_state_dict(self, mode: str) -> dict:
        """'opt': {"<param>.<state>": tensor or checkpoint leaf}; 'all': the model's entries (a ZeRO optimizer's
        checkpoint leaves for the parameters it shards, which hold no data between steps at stage 3) and those."""
        state = self._training_state()
        opt = {f"{p}.{k}": v for p, states in state.get("optimizer", {}).items() for k, v in states.items()}
        if mode == "opt":
            return opt
        sd = self._param_entries(state)
        clash = sorted(set(sd) & set(opt))
        if clash:
            raise ValueError(f"DistModel.state_dict('all'): optimizer state names {clash[:3]} collide with model "
                             f"entries; use state_dict('param') and state_dict('opt') apart")
        sd.update(opt)
        return sd

    def set_state_dict(self, state_dict: dict) -> None:
        """paddle's ``set_state_dict``: copy each value (a DistTensor in any layout, a paddle.Tensor or numpy
        array holding the global value) into the entry of ``state_dict('all')`` (or 'param' without an
        optimizer) of that name, in its own layout. Every rank takes part. Unknown names raise KeyError."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"set_state_dict expects a dict {{name: tensor}}, got {type(state_dict).__name__}")
        from autoparallel.api_dist_model_state import assign_all

        try:
            current = self._paddle_state_dict("all") if self.optimizer is not None else self._param_entries()
        except TypeError:                       # an optimizer that is not a paddle one: the model's entries only
            current = self._param_entries()
        unknown = sorted(k for k in state_dict if k not in current)
        if unknown:
            raise KeyError(f"set_state_dict: {unknown[:5]} are not entries of this DistModel's state dict "
                           f"(entries: {sorted(current)[:8]}{' ...' if len(current) > 8 else ''})")
        with self.whole_parameters():
            assign_all({k: (current[k], v) for k, v in state_dict.items()})

    def dist_main_program(self, mode=None):
        _no_program("dist_main_program")

    def dist_startup_program(self, mode=None):
        _no_program("dist_startup_program")

    def serial_main_program(self, mode=None):
        _no_program("serial_main_program")

    def serial_startup_program(self, mode=None):
        _no_program("serial_startup_program")


def _no_program(name: str):
    raise NotImplementedError(f"DistModel.{name}(): ap.to_static runs paddle's eager kernels with the captured "
                              f"layouts pinned, so there is no static Program; inspect the captured op graph with "
                              f"dist_model.graph (networkx) or print(dist_model)")
