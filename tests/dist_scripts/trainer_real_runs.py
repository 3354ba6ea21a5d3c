"""The Trainer runs of the real-rank Trainer jobs (trainer_real_worker.py on 4 ranks, trainer_resume2_worker.py on
2): PaddleFormers' Trainer (plain mode, sharding="") over a Llama laid out by ap.parallelize, or in one process on
the rank (``args.local_rank = -1``), on the same global batches of ``GLOBAL_BATCH`` rows."""
import importlib.machinery
import os
import sys
import types

import numpy as np
import paddle

try:
    from paddleformers.trainer import Trainer, TrainerCallback, TrainingArguments
except ImportError:                 # `datasets` needs a pyarrow built for another numpy: the Trainer only
    stub = types.ModuleType("datasets")                 # isinstance-checks datasets.Dataset
    stub.Dataset = type("Dataset", (), {})
    stub.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    sys.modules["datasets"] = stub
    from paddleformers.trainer import Trainer, TrainerCallback, TrainingArguments
    del sys.modules["datasets"]             # the stub is gone after the import

import autoparallel as ap
from autoparallel.testing import paddleformers_models as pfm

IDS, LABELS = pfm.batch(0, b=32, t=8)
GLOBAL_BATCH = 8


class Data(paddle.io.Dataset):
    def __len__(self):
        return len(IDS)

    def __getitem__(self, i):
        return {"input_ids": IDS[i], "labels": LABELS[i]}


class Losses(TrainerCallback):
    """The logged losses; with ``keep`` (one process), the parameters and the optimizer's flex states after
    step 2 (what the distributed run's ``save_steps=2`` checkpoint must hold) written to ``keep``."""
    def __init__(self, keep=None, evals=False):
        self.seen, self.keep, self.trainer, self.evals = [], keep, None, evals

    def on_log(self, args, state, control, logs=None, **kwargs):
        for k in ("loss", "eval_loss") if self.evals else ("loss",):
            if logs and k in logs:
                self.seen.append(logs[k])

    def on_step_end(self, args, state, control, **kwargs):
        if self.keep and state.global_step == 2 and paddle.distributed.get_rank() == 0:
            model, opt = self.trainer.model, self.trainer.optimizer
            np.savez(self.keep + "_model.npz", **{k: v.numpy() for k, v in model.state_dict().items()})
            flex = opt.sharded_state_dict(model.sharded_state_dict())
            np.savez(self.keep + "_opt.npz", **{k: v.local_tensor.numpy() for k, v in flex.items()})


def run(out, dp=1, tp=1, accumulate=1, clip=0.0, sgd_clip=None, save_dir=None, own=False, keep=None, stage=0,
        steps=3, final=True, resume=None, **extra):
    """(logged losses, {name: global parameter}) after ``steps`` steps; dp = tp = 1: the one-process Trainer. The
    optimizer: the Trainer's own AdamW (``own``), SGD with ``sgd_clip`` (0: no clipping), else AdamW handed over.
    ``stage``: ZeRO over the data axis; ``save_dir``: checkpoints every 2 steps (and ``save_model`` at the end
    with ``final``); ``resume``: ``train(resume_from_checkpoint=resume)``; ``extra``: more TrainingArguments."""
    model = pfm.build("llama", 0)
    opt = None if own else paddle.optimizer.AdamW(1e-3, parameters=model.parameters(), weight_decay=0.0)
    if sgd_clip is not None:
        opt = paddle.optimizer.SGD(0.5, parameters=model.parameters(),
                                   grad_clip=paddle.nn.ClipGradByGlobalNorm(sgd_clip) if sgd_clip else None)
    if dp * tp > 1:
        s = ap.Strategy()
        s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
        if stage:
            s.sharding.enable, s.sharding.stage = True, stage
        model, opt = ap.parallelize(model, opt, strategy=s)
    args = TrainingArguments(
        output_dir=save_dir or os.path.join(out, f"scratch{paddle.distributed.get_rank()}"), max_steps=steps, seed=0,
        per_device_train_batch_size=GLOBAL_BATCH // dp // accumulate, gradient_accumulation_steps=accumulate,
        dataloader_shuffle=False, learning_rate=1e-3, weight_decay=0.0, max_grad_norm=clip, sharding="",
        amp_master_grad=False, logging_steps=1, report_to=[], disable_tqdm=True,
        save_strategy="steps" if save_dir else "no", save_steps=2, **extra)
    if dp * tp == 1:
        args.local_rank = -1                       # one process: no data parallelism of the Trainer's own
    losses = Losses(keep)
    trainer = Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None), callbacks=[losses])
    losses.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    if save_dir and final:
        trainer.save_model(os.path.join(save_dir, "final"))
    return losses.seen, {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in model.named_parameters()}


def diff(got, want, tail=None) -> dict:
    """Largest differences of the logged losses (with ``tail``: a resumed run's ``tail`` losses against the last
    ones of ``want``) and of every parameter; ``moved``: how far ``want``'s parameters are from the initial ones."""
    if not want[0] or len(got[0]) != (tail or len(want[0])):
        return {"error": f"logged losses {got[0]} vs {want[0]}"}
    initial = pfm.build("llama", 0).state_dict()
    return {"loss": max(abs(a - b) for a, b in zip(got[0], want[0][-len(got[0]):])),
            "param": max(float(np.abs(got[1][n] - v).max()) for n, v in want[1].items()),
            "moved": max(float(np.abs(v - initial[n].numpy()).max()) for n, v in want[1].items())}
