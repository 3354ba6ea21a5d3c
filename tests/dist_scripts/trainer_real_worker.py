"""Every rank of 4 (gloo): PaddleFormers' Trainer (plain mode, sharding="") over a Llama laid out by ap.parallelize
(dp 4; dp 2 x tp 2), against the same Trainer in one process on the same global batches (computed on the rank:
``args.local_rank = -1`` makes it a one-process Trainer). Checks per case: the logged losses, every parameter at the
end; dp 2 x tp 2 also writes a ``save_steps`` flex checkpoint and a final ``save_model`` (the test loads them in
one process). Negative control: clipping on in the distributed run only must differ from the unclipped reference.

Then hapi's paddle.Model (hapi_real_cases.py). argv: the job's output directory. Reports {case: {"loss", "param"} (largest differences) or {"error"}}."""
import importlib.machinery
import os
import sys
import traceback
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
import hapi_real_cases
from autoparallel.testing import paddleformers_models as pfm
from autoparallel.testing.launch import write_result

ap.init_parallel_env()
RANK = paddle.distributed.get_rank()
OUT = sys.argv[1]
IDS, LABELS = pfm.batch(0, b=16, t=8)
GLOBAL_BATCH = 8


class Data(paddle.io.Dataset):
    def __len__(self):
        return len(IDS)

    def __getitem__(self, i):
        return {"input_ids": IDS[i], "labels": LABELS[i]}


class Losses(TrainerCallback):
    """The logged losses; with ``keep`` (one process), the parameters and the optimizer's flex states after
    step 2 (what the distributed run's ``save_steps=2`` checkpoint must hold) written to ``keep``."""
    def __init__(self, keep=None):
        self.seen, self.keep, self.trainer = [], keep, None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.seen.append(logs["loss"])

    def on_step_end(self, args, state, control, **kwargs):
        if self.keep and state.global_step == 2 and RANK == 0:
            model, opt = self.trainer.model, self.trainer.optimizer
            np.savez(self.keep + "_model.npz", **{k: v.numpy() for k, v in model.state_dict().items()})
            flex = opt.sharded_state_dict(model.sharded_state_dict())
            np.savez(self.keep + "_opt.npz", **{k: v.local_tensor.numpy() for k, v in flex.items()})


def run(dp=1, tp=1, accumulate=1, clip=0.0, sgd_clip=None, save_dir=None, own=False, keep=None):
    """(logged losses, {name: global parameter}) after 3 steps; dp = tp = 1: the one-process Trainer. The
    optimizer: the Trainer's own AdamW (``own``), SGD with ``sgd_clip`` (0: no clipping), else AdamW handed over."""
    model = pfm.build("llama", 0)
    opt = None if own else paddle.optimizer.AdamW(1e-3, parameters=model.parameters(), weight_decay=0.0)
    if sgd_clip is not None:
        opt = paddle.optimizer.SGD(0.5, parameters=model.parameters(),
                                   grad_clip=paddle.nn.ClipGradByGlobalNorm(sgd_clip) if sgd_clip else None)
    if dp * tp > 1:
        s = ap.Strategy()
        s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
        model, opt = ap.parallelize(model, opt, strategy=s)
    args = TrainingArguments(
        output_dir=save_dir or os.path.join(OUT, f"scratch{RANK}"), max_steps=3, seed=0,
        per_device_train_batch_size=GLOBAL_BATCH // dp // accumulate, gradient_accumulation_steps=accumulate,
        dataloader_shuffle=False, learning_rate=1e-3, weight_decay=0.0, max_grad_norm=clip, sharding="",
        amp_master_grad=False, logging_steps=1, report_to=[], disable_tqdm=True,
        save_strategy="steps" if save_dir else "no", save_steps=2)
    if dp * tp == 1:
        args.local_rank = -1                       # one process: no data parallelism of the Trainer's own
    losses = Losses(keep)
    trainer = Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None), callbacks=[losses])
    losses.trainer = trainer
    trainer.train()
    if save_dir:
        trainer.save_model(os.path.join(save_dir, "final"))
    return losses.seen, {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in model.named_parameters()}


def diff(got, want) -> dict:
    if len(got[0]) != len(want[0]) or not want[0]:
        return {"error": f"logged losses {got[0]} vs one process {want[0]}"}
    return {"loss": max(abs(a - b) for a, b in zip(got[0], want[0])),
            "param": max(float(np.abs(got[1][n] - v).max()) for n, v in want[1].items()),
            "moved": max(float(np.abs(v - pfm.build("llama", 0).state_dict()[n].numpy()).max())
                         for n, v in want[1].items())}


def checkpointed():
    want = run(keep=os.path.join(OUT, "step2"))
    got = run(2, 2, save_dir=os.path.join(OUT, "dist"))
    if RANK == 0:
        np.savez(os.path.join(OUT, "dist_params.npz"), **got[1])
    return diff(got, want)


CASES = {
    "dp2 x tp2 (AdamW handed over), save_steps + save_model": checkpointed,
    "dp4, the Trainer's own AdamW, max_grad_norm 0.05, accumulation 2":
        lambda: diff(run(4, 1, accumulate=2, clip=0.05, own=True), run(accumulate=2, clip=0.05, own=True)),
    "dp2 x tp2, accumulation 2, SGD with ClipGradByGlobalNorm(0.05)": lambda: clipped()[0],
    "control: clipped vs unclipped": lambda: clipped()[1],
}
_CLIPPED = []


def clipped():
    """(the clipped distributed run vs the clipped one-process run, vs the unclipped one: the control, must
    differ), run once."""
    if not _CLIPPED:
        got = run(2, 2, accumulate=2, sgd_clip=0.05)
        _CLIPPED[:] = [diff(got, run(accumulate=2, sgd_clip=0.05)), diff(got, run(accumulate=2, sgd_clip=0.0))]
    return _CLIPPED


out = {}
sync = paddle.device.synchronize                # the Trainer calls it when accumulating; paddle refuses it on CPU
paddle.device.synchronize = lambda *a, **k: None
try:
    for name, fn in {**CASES, **{
            k: (lambda f=f: f(OUT)) for k, f in hapi_real_cases.CASES.items()}}.items():
        if os.environ.get("AP_ONLY") and os.environ["AP_ONLY"] not in name:
            continue
        try:
            out[name] = fn()
        except Exception:                               # noqa: BLE001  (reported per case)
            out[name] = {"error": traceback.format_exc()[-3000:]}
finally:
    paddle.device.synchronize = sync
write_result({"rank": RANK, "cases": out})
