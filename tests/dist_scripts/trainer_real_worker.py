"""Every rank of 4 (gloo): PaddleFormers' Trainer (plain mode, sharding="") over a Llama laid out by ap.parallelize
(dp 4; dp 2 x tp 2), against the same Trainer in one process on the same global batches (computed on the rank:
``args.local_rank = -1`` makes it a one-process Trainer; trainer_real_runs.py). Checks per case: the logged losses,
every parameter at the end; dp 2 x tp 2 also writes a ``save_steps`` flex checkpoint and a final ``save_model``
(the test loads them in one process). Negative control: clipping on in the distributed run only must differ from
the unclipped reference. Then the checkpoints under ZeRO and their resume (trainer_resume_cases.py) and hapi's
paddle.Model (hapi_real_cases.py). argv: the job's output directory. Reports {case: {"loss", "param"} (largest
differences) or {"error"}}."""
import os
import sys
import traceback

import numpy as np
import paddle

import autoparallel as ap
import hapi_real_cases
import trainer_pipeline_cases
import trainer_resume_cases
from autoparallel.testing.launch import write_result
from trainer_real_runs import diff, run

ap.init_parallel_env()
RANK = paddle.distributed.get_rank()
OUT = sys.argv[1]


def checkpointed():
    want = run(OUT, keep=os.path.join(OUT, "step2"))
    got = run(OUT, 2, 2, save_dir=os.path.join(OUT, "dist"))
    if RANK == 0:
        np.savez(os.path.join(OUT, "dist_params.npz"), **got[1])
    return diff(got, want)


CASES = {
    "dp2 x tp2 (AdamW handed over), save_steps + save_model": checkpointed,
    "dp4, the Trainer's own AdamW, max_grad_norm 0.05, accumulation 2":
        lambda: diff(run(OUT, 4, 1, accumulate=2, clip=0.05, own=True), run(OUT, accumulate=2, clip=0.05, own=True)),
    "dp2 x tp2, accumulation 2, SGD with ClipGradByGlobalNorm(0.05)": lambda: clipped()[0],
    "control: clipped vs unclipped": lambda: clipped()[1],
}
_CLIPPED = []


def clipped():
    """(the clipped distributed run vs the clipped one-process run, vs the unclipped one: the control, must
    differ), run once."""
    if not _CLIPPED:
        got = run(OUT, 2, 2, accumulate=2, sgd_clip=0.05)
        _CLIPPED[:] = [diff(got, run(OUT, accumulate=2, sgd_clip=0.05)),
                       diff(got, run(OUT, accumulate=2, sgd_clip=0.0))]
    return _CLIPPED


out = {}
sync = paddle.device.synchronize                # the Trainer calls it when accumulating; paddle refuses it on CPU
paddle.device.synchronize = lambda *a, **k: None
try:
    for name, fn in {**CASES, **{k: (lambda f=f: f(OUT)) for k, f in {
            **trainer_resume_cases.CASES, **hapi_real_cases.CASES,
            **trainer_pipeline_cases.FOUR}.items()}}.items():
        if os.environ.get("AP_ONLY") and os.environ["AP_ONLY"] not in name:
            continue
        try:
            out[name] = fn()
        except Exception:                               # noqa: BLE001  (reported per case)
            out[name] = {"error": traceback.format_exc()[-3000:]}
finally:
    paddle.device.synchronize = sync
write_result({"rank": RANK, "cases": out})
