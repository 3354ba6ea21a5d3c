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

Checkpoints: ``save_model`` (each ``save_steps`` checkpoint, a final save) writes ``ap.training_state(model,
opt)`` with ``ap.save_state_dict`` into ``<dir>/pipeline_state`` on every rank (each rank its stages' parameters
and optimizer states under the model's un-pipelined names: the checkpoint format of docs/checkpoints.md, which
loads under any layout); the Trainer's flex model / optimizer writers do nothing over a pipeline; it still writes
its own scheduler, RNG and trainer state. ``train(resume_from_checkpoint=...)`` reads ``pipeline_state`` back
with ``ap.load_state_dict`` (the optimizer's entries too unless ``ignore_load_lr_and_optim``), then the Trainer's
scheduler.

Refused when the Trainer is built (NotImplementedError naming the option): the Trainer's own optimizer (it would
not be the pipeline's wrapped optimizer, which reduces the data-parallel gradients and clips over every stage:
pass ``optimizers=(opt, None)`` with the optimizer ``ap.parallelize`` returned, its ``grad_clip`` for clipping),
``recompute_granularity`` / ``use_expert_parallel`` (the Trainer all-reduces every parameter over the whole
world itself: use ``Strategy.recompute``), ``fp16`` / ``bf16`` (use ``Strategy.amp``),
``load_best_model_at_end`` (it reloads the best checkpoint through PaddleFormers' own loader), the other
checkpoint formats (trainer_resume.refuse_forms). A resume from a directory without ``pipeline_state``:
FileNotFoundError.
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


def refuse_options(targs, optimizer) -> None:
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
    if getattr(targs, "load_best_model_at_end", False):
        bad.append("load_best_model_at_end=True")
    if bad:
        raise NotImplementedError(f"{WHO}: cannot honour {'; '.join(bad)}")


STATE_DIR = "pipeline_state"


def save(trainer, output_dir=None) -> str:
    """The Trainer's ``save_model`` over a pipeline (every rank: collective): ``ap.training_state(model, opt)``
    (each rank its stages' parameters and optimizer states under the model's names) with
    ``ap.save_state_dict`` into ``<output_dir>/pipeline_state``."""
    import os

    from autoparallel.checkpoint.save import save_state_dict
    from autoparallel.checkpoint.state import training_state

    path = os.path.join(output_dir or trainer.args.output_dir, STATE_DIR)
    return save_state_dict(training_state(trainer.model, trainer.optimizer), path, overwrite=True)


def load(trainer, checkpoint: str, with_optimizer: bool) -> None:
    """``train(resume_from_checkpoint=checkpoint)``: the parameters (and optimizer states) from the checkpoint's
    ``pipeline_state`` laid out on this pipeline (``ap.load_state_dict``: any layout, names checked)."""
    import os

    from autoparallel.checkpoint.load import load_state_dict
    from autoparallel.checkpoint.state import training_state

    path = os.path.join(checkpoint, STATE_DIR)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{WHO}: resume_from_checkpoint={checkpoint!r} holds no {STATE_DIR}/ (what the "
                                f"Trainer writes over a pipeline); got {sorted(os.listdir(checkpoint))}")
    load_state_dict(training_state(trainer.model, trainer.optimizer if with_optimizer else None), path,
                    strict=with_optimizer)     # ignore_load_lr_and_optim: the optimizer's entries are left unread


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
