"""PaddleFormers' Trainer over a pipeline-parallel Llama (4 layers, untied; ap.parallelize with
pipeline_parallel.degree 2, 1F1B over 2 micro-batches) on the ranks of a launch: pp 2 x dp 2 on the 4 ranks of
trainer_real_worker.py, pp 2 on the 2 of trainer_resume2_worker.py. Against the same Trainer in one process on the
rank (``args.local_rank = -1``), on the same global batches: every logged loss (the evaluation loss of the Trainer's
evaluation loop too) and every parameter this rank's stages hold. Every rank samples the whole global batch (the
pipeline cuts it); gradient accumulation 2 and an optimizer with ClipGradByGlobalNorm (what clips with the
optimizer handed over) in one case. hapi's ``Model(pipe).prepare`` is refused by name. Reports {case: {"loss",
"param", "moved"} or {"error"} or {"refused": message}}."""
import os

import numpy as np
import paddle

import autoparallel as ap
from autoparallel.testing import paddleformers_models as pfm
from trainer_real_runs import Data, Losses, Trainer, TrainingArguments

GLOBAL_BATCH = 8


def llama():
    return pfm.build("llama", 0, tie_word_embeddings=False, num_hidden_layers=4)


def run(out, pp=1, dp=1, accumulate=1, clip=0.0, evals=True, steps=3, save_dir=None, resume=None, **extra):
    """(logged losses and evaluation losses, {name: global parameter of this rank's stages}); pp = 1: one process.
    ``save_dir``: checkpoints every 2 steps there; ``resume``: ``train(resume_from_checkpoint=resume)``."""
    model = llama()
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters(), weight_decay=0.0,
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(clip) if clip else None)
    if pp > 1:
        s = ap.Strategy()
        s.pipeline_parallel.degree, s.pipeline_parallel.micro_batches, s.data_parallel.degree = pp, 2, dp
        model, opt = ap.parallelize(model, opt, strategy=s)
    ev = dict(evaluation_strategy="steps", eval_steps=2, per_device_eval_batch_size=GLOBAL_BATCH) if evals else {}
    args = TrainingArguments(
        output_dir=save_dir or os.path.join(out, f"pipe{paddle.distributed.get_rank()}"), max_steps=steps, seed=0,
        per_device_train_batch_size=GLOBAL_BATCH // accumulate, gradient_accumulation_steps=accumulate,
        dataloader_shuffle=False, learning_rate=1e-3, weight_decay=0.0, max_grad_norm=clip, sharding="",
        amp_master_grad=False, logging_steps=1, report_to=[], disable_tqdm=True,
        save_strategy="steps" if save_dir else "no", save_steps=2, **ev, **extra)
    if pp == 1:
        args.local_rank = -1                       # one process: no data parallelism of the Trainer's own
    losses = Losses(evals=True)
    Trainer(model=model, args=args, train_dataset=Data(), eval_dataset=Data() if evals else None,
            optimizers=(opt, None), callbacks=[losses]).train(resume_from_checkpoint=resume)
    return losses.seen, {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in model.named_parameters()}


def diff(got, want, tail=None) -> dict:
    if not want[0] or len(got[0]) != (tail or len(want[0])) or not got[1]:
        return {"error": f"logged losses {got[0]} vs {want[0]}; {len(got[1])} parameters held"}
    start = llama().state_dict()
    return {"loss": max(abs(a - b) for a, b in zip(got[0], want[0][-len(got[0]):])), "logged": len(got[0]),
            "param": max(float(np.abs(v - want[1][n]).max()) for n, v in got[1].items()),
            "moved": max(float(np.abs(v - start[n].numpy()).max()) for n, v in got[1].items())}


def hapi_refused(out):
    s = ap.Strategy()
    s.pipeline_parallel.degree, s.pipeline_parallel.micro_batches = 2, 2
    s.data_parallel.degree = paddle.distributed.get_world_size() // 2
    model = llama()
    pipe, opt = ap.parallelize(model, paddle.optimizer.AdamW(1e-3, parameters=model.parameters()), strategy=s)
    try:
        paddle.Model(pipe).prepare(opt, paddle.nn.CrossEntropyLoss())
    except NotImplementedError as e:
        return {"refused": str(e)}
    return {"error": "hapi's Model(pipe).prepare was not refused"}


_RESUMED = []


def resumed(out):
    """pp 2 x dp 2 saving every 2 of 4 steps; a new Trainer over a new pipeline resumes from checkpoint-2 (losses
    3-4, every parameter, against one process's 4 steps); the control loads the parameters alone
    (``ignore_load_lr_and_optim``: the Trainer then runs its 4 steps again from them): its parameters must differ."""
    if not _RESUMED:
        ckpt = os.path.join(out, "pipe_ckpt")
        want = run(out, steps=4, evals=False)
        saving = run(out, 2, 2, steps=4, evals=False, save_dir=ckpt)
        back = os.path.join(ckpt, "checkpoint-2")
        got = run(out, 2, 2, steps=4, evals=False, resume=back)
        control = run(out, 2, 2, steps=4, evals=False, resume=back, ignore_load_lr_and_optim=True)
        _RESUMED[:] = [{**diff(got, want, tail=2), "saving": diff(saving, want)["param"]},
                       {"param": max(float(np.abs(v - want[1][n]).max()) for n, v in control[1].items())}]
    return _RESUMED


FOUR = {
    "pipe: pp2 x dp2, save_steps, resume in a new Trainer": lambda out: resumed(out)[0],
    "pipe control: resumed without the optimizer states": lambda out: resumed(out)[1],
    "pipe: pp2 x dp2, accumulation 2, ClipGradByGlobalNorm(0.05), evaluation":
        lambda out: diff(run(out, 2, 2, accumulate=2, clip=0.05), run(out, accumulate=2, clip=0.05)),
    "pipe: hapi refused": hapi_refused,
}
TWO = {
    "pipe: pp2, evaluation": lambda out: diff(run(out, 2), run(out)),
    "pipe: hapi refused": hapi_refused,
}
