"""``paddle.Model`` (hapi) over a distributed model in one process (``ap.simulate``, or one rank's view).

hapi turns every loss, metric input and prediction into numpy with its ``to_numpy``, which accepts only
paddle's own tensor types: a DistTensor output (the model's logits, a distributed loss) failed there with
``AssertionError: not a variable``. The patched ``to_numpy`` reads a distributed tensor as its global value
(``np.asarray(t)``, gathered), as one process would see it, and passes everything else to paddle's.

``model.save(path)`` writes what one process writes: paddle's ``paddle.save(network.state_dict())`` would pickle
each distributed parameter's local shard (a tensor-parallel shard, or nothing for a released ZeRO-3 parameter),
so the adapter's save stores every distributed entry of the parameter and optimizer states as its global
value; ``model.load`` then lays global values out on the shards (``set_value``), its shape check reading a
distributed parameter's global shape (paddle's compares with the local shard's and refused every
tensor-parallel entry).

On several launched ranks hapi would wrap the network in ``paddle.DataParallel`` and feed each rank its own part
of the data: there the model's own data parallelism runs instead (hapi_ranks.py).
"""
from __future__ import annotations

import os
import pickle
import warnings

import numpy as np

from autoparallel import patches, trainer_pipeline


def install() -> None:
    from paddle.hapi import model as hapi_model

    orig = hapi_model.to_numpy
    if getattr(orig, "_ap_wrapper", False):
        return

    def to_numpy(var):
        from autoparallel.dist_tensor import is_dist

        if is_dist(var):
            return np.asarray(var)
        return orig(var)

    to_numpy._ap_wrapper = True
    patches.patch(hapi_model, "to_numpy", to_numpy)
    patches.patch(hapi_model.DynamicGraphAdapter, "save", _save(hapi_model.DynamicGraphAdapter.save))
    patches.patch(hapi_model.Model, "load", _load(hapi_model.Model.load))
    patches.patch(hapi_model.Model, "prepare", _prepare(hapi_model.Model.prepare))
    from autoparallel import hapi_ranks

    hapi_ranks.install(hapi_model)


def _prepare(orig):
    def prepare(self, *args, **kwargs):
        if trainer_pipeline.is_pipeline(self.network):
            raise NotImplementedError(trainer_pipeline.HAPI_WHY)
        return orig(self, *args, **kwargs)

    prepare._ap_wrapper = True
    return prepare


def _global(state: dict) -> dict:
    """The state dict with every distributed value replaced by its global (gathered) tensor."""
    from autoparallel.dist_tensor import is_dist

    return {k: (v.full() if is_dist(v) else _global(v) if isinstance(v, dict) else v) for k, v in state.items()}


def _save(orig):
    def save(self, path):
        import paddle

        from autoparallel.dist_tensor import is_dist

        params = self.model.network.state_dict()
        if not any(is_dist(v) for v in params.values()):
            return orig(self, path)
        paddle.save(_global(params), path + ".pdparams")
        opt = self.model._optimizer
        if opt is not None and opt.state_dict():
            paddle.save(_global(opt.state_dict()), path + ".pdopt")
        scaler = getattr(self.model, "_scaler", None)
        if scaler is not None and scaler.state_dict():
            paddle.save(scaler.state_dict(), path + ".pdscaler")

    save._ap_wrapper = True
    return save


def _load(orig):
    def load(self, path, skip_mismatch=False, reset_optimizer=False):
        from autoparallel.dist_tensor import is_dist

        net = self.network.state_dict()
        if not any(is_dist(p) and list(p.shape) != list(p.global_shape) for p in net.values()):
            return orig(self, path, skip_mismatch, reset_optimizer)
        base, ext = os.path.splitext(path)
        path = base if ext in ("", ".pdparams", ".pdopt", ".pdmodel") else path
        state = _read(path + ".pdparams")
        if not state:
            raise ValueError(f"paddle.Model.load: no parameters at {path}.pdparams")
        pairs = []
        for key, p in net.items():
            want = list(p.global_shape) if is_dist(p) else list(p.shape)
            v = state.get(key)
            bad = (f"{key} is not found in the providing file." if v is None else
                   f"{key} receives a shape {list(v.shape)}, but the expected (global) shape is {want}."
                   if list(v.shape) != want else None)
            if bad is None:
                pairs.append((p, v))
            elif skip_mismatch:
                warnings.warn(f"Skip loading for {key}. " + bad)
                reset_optimizer = True
            else:
                raise ValueError(bad)
        optim = None if reset_optimizer else _read(path + ".pdopt")
        scaler = None
        if getattr(self, "_scaler", None) is not None and os.path.exists(path + ".pdscaler"):
            import paddle

            scaler = paddle.load(path + ".pdscaler")
        return self._adapter.load(pairs, optim, scaler)

    load._ap_wrapper = True
    return load


def _read(path):
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f, encoding="latin1")
