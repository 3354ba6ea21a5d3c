"""PaddleFormers' ``Trainer`` (plain mode) on several launched ranks over a model ``ap.parallelize`` (or
``ap.DataParallel``) laid out: run, as one process would on the same global batches.

On N ranks the Trainer would set up its own data parallelism: ``paddle.DataParallel`` over the model (a second
reduction of gradients this model already reduces) and a ``DistributedBatchSampler`` giving each of the N ranks
its own part of every global batch (tensor-parallel peers need the same part). Here, for such a Trainer:

* its data-parallel world is the model's: ``args.dataset_world_size`` / ``args.dataset_rank`` read the degree
  and this rank's index over the mesh's ``data`` dim, so its sampler hands each data-parallel rank its
  ``per_device_train_batch_size`` rows of a global batch of ``per_device_train_batch_size x dp`` rows
  (tensor-parallel peers get the same rows; the logged batch size and step counts follow);
* each batch ``_prepare_inputs`` returns is laid out as the local parts they are: every tensor becomes a
  DistTensor sharded on its batch dim over ``data`` from the rank's rows (``dtensor_from_local``, the
  ``is_dataset_splitted=True`` layout of ``ap.shard_dataloader``), after checking that tensor-parallel peers
  hold the same rows (data_agree.py); the model's input sharding passes DistTensors through;
* ``_wrap_model`` leaves the model unwrapped (no ``paddle.DataParallel``): its gradients are reduced here;
* the step's loss is its global value on every rank (trainer_forms.py), so the Trainer's logged mean over ranks
  is the global loss;
* ``save_model`` (``save_steps`` checkpoints, the final save) writes what one process writes: every rank gathers
  the distributed parameters' global values, the saving rank writes them (``save_pretrained(state_dict=...)``
  for a PaddleFormers model, ``paddle.save`` of the state dict otherwise).

Refused when the Trainer is built (NotImplementedError naming the option): the Trainer's own hybrid or auto
parallelism (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``, ``sharding``,
``enable_auto_parallel``), its mixed precision (``fp16`` / ``bf16``: use ``Strategy.amp``), a model without the
input sharding of ``ap.parallelize`` (``ap.shard_layer`` models: the Trainer's batches carry no layout),
``save_checkpoint_format="unified_checkpoint"``; the checkpoint forms of
trainer_resume.py. Under ZeRO (``Strategy.sharding``) the flex checkpoints hold the whole optimizer states too
(``opt.state_dict()`` of the ZeRO optimizer, gathered) and resume through trainer_resume.py. A pipeline-parallel
model (``setup_pipeline``): every rank is given the whole global batch, plain (trainer_pipeline.py).
"""
from __future__ import annotations

import weakref

from autoparallel.compat import SideData

_RANKED = SideData()          # Trainer -> Ranked
_ARGS: dict = {}              # id(TrainingArguments) -> (dp degree, data-parallel index)
DATA = "data"


class Ranked:
    def __init__(self, mesh, dp: int, index: int, pipeline: bool = False):
        self.mesh, self.dp, self.index, self.pipeline = mesh, dp, index, pipeline


def ranked(trainer):
    return _RANKED.get(trainer)


def setup(trainer, model, targs, world: int) -> None:
    """Called as the Trainer is built on ``world`` > 1 ranks over a model holding distributed parameters."""
    _refuse_options(targs, world)
    r = layout(model, world, "PaddleFormers' Trainer")
    _RANKED.set(trainer, r)
    key = id(targs)
    _ARGS[key] = (r.dp, r.index)
    weakref.finalize(targs, _ARGS.pop, key, None)


def setup_pipeline(trainer, targs, world: int) -> None:
    """A pipeline-parallel model (trainer_pipeline.py): every rank is given the same global batch, plain."""
    _refuse_options(targs, world)
    _RANKED.set(trainer, Ranked(None, 1, 0, pipeline=True))
    key = id(targs)
    _ARGS[key] = (1, 0)
    weakref.finalize(targs, _ARGS.pop, key, None)


def layout(model, world: int, who: str) -> Ranked:
    """The data-parallel layout of ``model`` for a training loop that hands each rank its part of the batch;
    refused (naming ``who``) for a model without ap.parallelize's data dim, or pipelined."""
    from autoparallel import layer_state
    from autoparallel.comm.world import current_world
    from autoparallel.data import data_rank

    mesh = layer_state.mesh_of(model)
    name = type(model).__name__
    if mesh is None or DATA not in mesh.dim_names:
        raise NotImplementedError(
            f"{who} on {world} launched ranks over {name}: its batches are each rank's part of the "
            f"global batch, laid out here over the 'data' dim of ap.parallelize's mesh; {name} has "
            f"{'no such mesh (ap.shard_layer)' if mesh is None else f'a mesh with dims {mesh.dim_names}'}. "
            f"Parallelize it with ap.parallelize / ap.DataParallel, or write the training loop over it")
    extra = [d for d in mesh.dim_names if d not in (DATA, "model") and mesh.shape[mesh.dim_index(d)] > 1]
    if extra:
        raise NotImplementedError(f"{who} on {world} launched ranks over {name} laid out over mesh dims {extra} "
                                  f"(pipeline parallel): its step runs one forward and backward; train a "
                                  f"pipelined model with its own schedule")
    dp, index = data_rank(mesh, current_world().rank, [DATA])
    return Ranked(mesh, dp, index)


def _refuse_options(targs, world: int) -> None:
    bad = []
    for opt in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "sep_parallel_size",
                "context_parallel_size", "expert_model_parallel_size"):
        if (getattr(targs, opt, 1) or 1) > 1:
            bad.append(f"{opt}={getattr(targs, opt)}")
    for opt in ("enable_auto_parallel", "fp16", "bf16", "use_expert_parallel"):
        if getattr(targs, opt, False):
            bad.append(f"{opt}=True")
    if getattr(targs, "sharding", None):             # its default, "stage1", on several ranks
        bad.append(f"sharding={' '.join(getattr(o, 'value', str(o)) for o in targs.sharding)!r}")
    fmt = getattr(targs, "save_checkpoint_format", None)
    if fmt == "unified_checkpoint":
        bad.append(f"save_checkpoint_format={fmt!r}")
    if bad:
        raise NotImplementedError(
            f"PaddleFormers' Trainer on {world} launched ranks over a model distributed by autoparallel runs in plain "
            f"data-parallel mode only; got {', '.join(bad)}. Set the layout with ap.parallelize's Strategy "
            f"(tensor_parallel, sharding, amp) and pass TrainingArguments(sharding=\"\") (plain mode; its default "
            f"sharding=\"stage1\" sets up fleet's sharding) with these left unset")


def dataset_property(orig, which: int):
    """``TrainingArguments.dataset_world_size`` (which=0) / ``dataset_rank`` (1): the model's data-parallel
    degree / index for a Trainer set up here."""
    def get(self):
        got = _ARGS.get(id(self))
        return orig.fget(self) if got is None else got[which]

    return property(get)


def as_parts(trainer, inputs):
    """The batch ``inputs`` (this rank's rows) as DistTensors sharded on dim 0 over the data dim."""
    r = ranked(trainer)
    return inputs if r is None or r.pipeline else _nested(inputs, r)


def _nested(x, r):
    import numpy as np
    import paddle

    if isinstance(x, np.ndarray) and x.ndim:
        x = paddle.to_tensor(x)
    if isinstance(x, dict):
        return type(x)((k, _nested(v, r)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(_nested(v, r) for v in x)
    if not isinstance(x, paddle.Tensor) or x.ndim == 0:
        return x
    from autoparallel.dist_tensor import dtensor_from_local, is_dist
    from autoparallel.data_agree import check_agree
    from autoparallel.placement import Replicate, Shard

    if is_dist(x):
        return x
    check_agree(x, r.mesh, DATA, True, f"a batch tensor {x.dtype} {list(x.shape)}")
    pl = [Shard(0) if d == DATA else Replicate() for d in r.mesh.dim_names]
    return dtensor_from_local(x, r.mesh, pl)


def global_state(model) -> dict:
    """The model's state dict with every distributed entry as its gathered global value (collective: every
    rank calls it)."""
    from autoparallel.dist_tensor import is_dist

    return {k: (v.full() if is_dist(v) else v) for k, v in model.state_dict().items()}


def optimizer_sharded(model, opt) -> dict:
    """``opt.sharded_state_dict(...)`` as one process writes it (``{struct_name}.{state}`` keys, whole
    values; whole_state.py). Collective: every rank runs it."""
    from paddle.distributed import ShardedWeight

    from autoparallel.whole_state import optimizer_whole

    out = {}
    for name, t in optimizer_whole(model, opt, structured=True).items():
        out[name] = ShardedWeight(key=name, local_tensor=t, local_shape=tuple(t.shape),
                                  global_shape=tuple(t.shape), global_offset=(0,) * len(t.shape))
    return out


class FlexOptimizerView:
    """The Trainer's optimizer while it writes its flex checkpoint: ``sharded_state_dict`` gives the whole
    states (``optimizer_sharded``); everything else is the optimizer's."""
    def __init__(self, model, opt):
        self._model, self._opt = model, opt

    def sharded_state_dict(self, *_args, **_kwargs):
        return optimizer_sharded(self._model, self._opt)

    def __getattr__(self, name):
        return getattr(self._opt, name)
