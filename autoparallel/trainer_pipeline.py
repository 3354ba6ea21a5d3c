"""PaddleFormers' ``Trainer`` (plain mode) over a pipeline-parallel model (``ap.parallelize`` with
``pipeline_parallel.degree > 1``).

The Trainer's step is the call form a pipeline honours (parallel/pipeline/called.py): ``loss =
model(**inputs).loss`` (or ``[0]``), ``(loss / k).backward()``, and every k micro-batches ``optimizer.step()``.
The pipeline runs its whole schedule inside the call, on the global batch that every rank is given, and reduces
its data-parallel gradients at the wrapped optimizer's step. So here:

* the Trainer's data-parallel world is one: ``args.dataset_world_size`` / ``dataset_rank`` read 1 / 0 on every
  launched rank (every rank samples the same global batch of ``per_device_train_batch_size`` rows; the pipeline
  cuts it into micro-batches and data-parallel parts itself), ``_prepare_inputs`` leaves the batch plain and
  ``_wrap_model`` adds no ``paddle.DataParallel``;
* the Trainer's ``model.no_sync()`` around the non-final accumulation steps is a null context while it trains:
  a pipeline's ``backward()`` reduces nothing (its reductions run at the optimizer's step), which is what
  ``no_sync`` asks; the pipeline's own ``no_sync()`` (for ``train_batch`` users) raises otherwise;
* evaluation runs the pipeline's forward-only path (``eval_batch``): the loss, on every rank.

Refused when the Trainer is built (NotImplementedError naming the option): the Trainer's own optimizer (it would
not be the pipeline's wrapped optimizer, which reduces the data-parallel gradients and clips over every stage:
pass ``optimizers=(opt, None)`` with the optimizer ``ap.parallelize`` returned, its ``grad_clip`` for clipping),
``recompute_granularity`` / ``use_expert_parallel`` (the Trainer all-reduces every parameter over the whole
world itself: use ``Strategy.recompute``), checkpoints (``save_strategy`` other than ``"no"``, a resume,
``load_best_model_at_end``: the Trainer's flex checkpoint is one process's state dict, while a pipeline rank holds
its stages only; save with ``ap.save_state_dict(model.checkpoint_state(opt), path)``), and an explicit
``save_model()``.
"""
from __future__ import annotations

import contextlib
import sys

WHO = "PaddleFormers' Trainer over a pipeline-parallel model"


HAPI_WHY = (
    "hapi's paddle.Model over a pipeline-parallel model: its train_batch / eval_batch compute the loss outside the "
    "network, loss_fn(network(inputs), labels), which a pipeline cannot run (its loss is computed on the last stage "
    "inside the schedule; the logits of every micro-batch never exist whole on one rank). What works: the "
    "one-process loop `loss = model(ids, labels=labels)` (or model(**batch).loss), `loss.backward()`, "
    "`opt.step()`; model.train_batch(inputs, labels) / model.eval_batch(inputs, labels); PaddleFormers' Trainer "
    "with optimizers=(opt, None)")


def is_pipeline(model) -> bool:
    """A PipelineModule (looked up where it lives: no pipeline exists before its module is imported)."""
    mod = sys.modules.get("autoparallel.parallel.pipeline.runtime")
    return mod is not None and isinstance(model, mod.PipelineModule)


def refuse_options(targs, optimizer, resume=None) -> None:
    """Before training: every Trainer option that cannot be honoured over a pipeline, by name."""
    bad = []
    if optimizer is None:
        bad.append("optimizers=(None, ...) (the Trainer's own optimizer: pass optimizers=(opt, None) with the "
                   "optimizer ap.parallelize returned, which reduces the data-parallel gradients and clips over "
                   "every stage; its grad_clip stands for max_grad_norm)")
    if getattr(targs, "recompute_granularity", None) is not None:
        bad.append(f"recompute_granularity={targs.recompute_granularity!r} (the Trainer all-reduces every "
                   f"parameter over the whole world itself; use Strategy.recompute)")
    if getattr(targs, "use_expert_parallel", False):
        bad.append("use_expert_parallel=True")
    for opt in ("fp16", "bf16"):
        if getattr(targs, opt, False):
            bad.append(f"{opt}=True (use Strategy.amp)")
    save = getattr(getattr(targs, "save_strategy", "no"), "value", getattr(targs, "save_strategy", "no"))
    if save != "no":
        bad.append(f"save_strategy={save!r}")
    if getattr(targs, "load_best_model_at_end", False):
        bad.append("load_best_model_at_end=True")
    if resume or getattr(targs, "resume_from_checkpoint", None):
        bad.append(f"resume_from_checkpoint={resume or targs.resume_from_checkpoint!r}")
    if bad:
        raise NotImplementedError(
            f"{WHO}: cannot honour {'; '.join(bad)}. Checkpoints: the Trainer's are one process's state dict, "
            f"while each pipeline rank holds its stages only; save and resume with "
            f"ap.save_state_dict(model.checkpoint_state(opt), path) / ap.load_state_dict outside the Trainer")


def refuse_save(trainer) -> None:
    raise NotImplementedError(f"{WHO}: save_model() writes one process's state dict, while each pipeline rank "
                              f"holds its stages only; save with ap.save_state_dict(model.checkpoint_state(opt), "
                              f"path)")


@contextlib.contextmanager
def _null_no_sync(self):
    yield


def accumulating(model):
    """While the Trainer trains ``model``: its ``no_sync()`` is a null context (a pipeline's backward reduces
    nothing; its reductions run at the optimizer's step)."""
    from autoparallel import patches

    if not is_pipeline(model):
        return contextlib.nullcontext()
    return patches.swapped(type(model), {"no_sync": _null_no_sync})
