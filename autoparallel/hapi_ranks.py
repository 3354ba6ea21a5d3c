"""hapi's ``paddle.Model`` on several launched ranks over a model ``ap.parallelize`` laid out: run as one process
would on the same global batches.

On N ranks hapi wraps the network in ``paddle.DataParallel`` (a second reduction of gradients the model already
reduces) and gives each of the N ranks its own part of every batch (``DistributedBatchSampler``). Here, for a
network holding distributed parameters:

* the adapter keeps the network unwrapped (no ``paddle.DataParallel``);
* while ``fit`` / ``evaluate`` / ``predict`` run, hapi's ``DistributedBatchSampler`` splits over the model's
  data-parallel degree and index (tensor-parallel peers get the same rows; ``batch_size`` is the rows of one
  data-parallel rank, as in hapi: the global batch is ``batch_size x dp``);
* each batch's inputs and labels are laid out as the local parts they are (trainer_ranks.as_parts: sharded on
  the batch dim over ``data``, tensor-parallel peers checked to agree); a loader the user built is taken the same
  way (its sampler must hand out data-parallel parts);
* losses, metrics and predictions read global values (hapi_forms.to_numpy); hapi's all-gather of evaluation
  outputs returns a distributed value's global value;
* ``Model.save`` (and ``fit(save_dir=...)``'s checkpoints) gathers on every rank and writes on rank 0 what one
  process writes: global parameters, whole optimizer states (whole_state.py).
"""
from __future__ import annotations

from autoparallel import patches, trainer_pipeline, trainer_ranks
from autoparallel.compat import SideData

_RANKED = SideData()          # DynamicGraphAdapter -> trainer_ranks.Ranked
_ACTIVE: list = []            # the Ranked of the fit / evaluate / predict running


def install(hapi_model) -> None:
    from paddle.hapi import callbacks

    A, M = hapi_model.DynamicGraphAdapter, hapi_model.Model
    patches.patch(A, "__init__", _adapter_init(A.__init__))
    for name in ("train_batch", "eval_batch", "predict_batch"):
        patches.patch(A, name, _batch(getattr(A, name)))
    for name in ("fit", "evaluate", "predict"):
        patches.patch(M, name, _active(getattr(M, name)))
    patches.patch(M, "save", _save(M.save))
    patches.patch(hapi_model, "DistributedBatchSampler", _sampler(hapi_model.DistributedBatchSampler))
    patches.patch(hapi_model, "_all_gather", _all_gather(hapi_model._all_gather))
    C = callbacks.ModelCheckpoint
    patches.patch(C, "on_epoch_end", _checkpoint_epoch(C.on_epoch_end))
    patches.patch(C, "on_train_end", _checkpoint_end(C.on_train_end))


def ranked(model):
    adapter = getattr(model, "_adapter", None)
    return None if adapter is None else _RANKED.get(adapter)


def _adapter_init(orig):
    def __init__(self, model):
        import paddle

        from autoparallel.dist_tensor import is_dist

        world = paddle.distributed.ParallelEnv().nranks
        net = model.network
        if world > 1 and trainer_pipeline.is_pipeline(net):
            raise NotImplementedError(trainer_pipeline.HAPI_WHY)
        if world < 2 or not any(is_dist(p) for p in net.parameters()):
            return orig(self, model)
        r = trainer_ranks.layout(net, world, "hapi's paddle.Model")
        with patches.swapped(paddle, {"DataParallel": lambda layers, *a, **k: layers}):
            orig(self, model)
        _RANKED.set(self, r)

    __init__._ap_wrapper = True
    return __init__


def _batch(orig):
    def batch(self, inputs, labels=None, *args, **kwargs):
        r = _RANKED.get(self)
        if r is None:
            return orig(self, inputs, labels, *args, **kwargs)
        from paddle.hapi.model import to_list

        inputs = [trainer_ranks._nested(x, r) for x in to_list(inputs)]
        if labels is not None:
            labels = [trainer_ranks._nested(x, r) for x in to_list(labels)]
        return orig(self, inputs, labels, *args, **kwargs)

    def predict_batch(self, inputs):
        r = _RANKED.get(self)
        if r is not None:
            from paddle.hapi.model import to_list

            inputs = [trainer_ranks._nested(x, r) for x in to_list(inputs)]
        return orig(self, inputs)

    out = predict_batch if orig.__name__ == "predict_batch" else batch
    out._ap_wrapper = True
    return out


def _active(orig):
    def run(self, *args, **kwargs):
        r = ranked(self)
        if r is None:
            return orig(self, *args, **kwargs)
        _ACTIVE.append(r)
        try:
            return orig(self, *args, **kwargs)
        finally:
            _ACTIVE.pop()

    run._ap_wrapper = True
    return run


def _sampler(cls):
    class DistributedBatchSampler(cls):
        """hapi's sampler: split over the model's data-parallel degree while a distributed model runs."""
        def __init__(self, dataset, batch_size, num_replicas=None, rank=None, *args, **kwargs):
            if _ACTIVE and num_replicas is None and rank is None:
                num_replicas, rank = _ACTIVE[-1].dp, _ACTIVE[-1].index
            super().__init__(dataset, batch_size, num_replicas, rank, *args, **kwargs)

    DistributedBatchSampler._ap_wrapper = True
    return DistributedBatchSampler


def _all_gather(orig):
    def all_gather(x):
        from autoparallel.dist_tensor import is_dist

        return x.full() if is_dist(x) else orig(x)

    all_gather._ap_wrapper = True
    return all_gather


def _checkpoint_epoch(orig):
    """``fit(save_dir=...)``'s checkpoints: hapi saves from rank 0 only; the save gathers, so every rank saves
    (the files are written by rank 0)."""
    def on_epoch_end(self, epoch, logs=None):
        if self.model is None or ranked(self.model) is None:
            return orig(self, epoch, logs)
        if self.save_dir and self.epoch % self.save_freq == 0:
            self.model.save(f"{self.save_dir}/{epoch}")
        return None

    on_epoch_end._ap_wrapper = True
    return on_epoch_end


def _checkpoint_end(orig):
    def on_train_end(self, logs=None):
        if self.model is None or ranked(self.model) is None:
            return orig(self, logs)
        if self.save_dir:
            self.model.save(f"{self.save_dir}/final")
        return None

    on_train_end._ap_wrapper = True
    return on_train_end


def _save(orig):
    def save(self, path, training=True):
        if ranked(self) is None:
            return orig(self, path, training)
        if not training:
            raise NotImplementedError("paddle.Model.save(path, training=False) (an inference model) on several "
                                      "launched ranks over a model distributed by autoparallel: save it with "
                                      "training=True and export from one process")
        import os

        import paddle

        from autoparallel.dist_tensor import is_dist
        from autoparallel.whole_state import optimizer_whole

        params = {k: (v.full() if is_dist(v) else v) for k, v in self.network.state_dict().items()}
        opt = None if self._optimizer is None else optimizer_whole(self.network, self._optimizer)
        sched = getattr(self._optimizer, "_learning_rate", None)
        if opt is not None and isinstance(sched, paddle.optimizer.lr.LRScheduler):
            opt["LR_Scheduler"] = sched.state_dict()    # paddle's load asserts it is there (and resumes it)
        if paddle.distributed.get_rank() != 0:
            return None
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        paddle.save(params, path + ".pdparams")
        if opt:
            paddle.save(opt, path + ".pdopt")
        return None

    save._ap_wrapper = True
    return save
