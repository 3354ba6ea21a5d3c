"""Every rank of 2 (gloo), new processes: PaddleFormers' Trainer resuming (``resume_from_checkpoint``) from the
checkpoint-2 the 4-rank job wrote under ZeRO (trainer_resume_cases.py), or under dp 2 x tp 2 (trainer_real_worker.py),
in another layout, 2 more steps, against
the same Trainer's 4 steps in one process on the rank. argv: the 4-rank job's output directory, this job's.
Reports {case: {"loss", "param"} (largest differences) or {"error"}}."""
import os
import sys
import traceback

import paddle

import autoparallel as ap
import trainer_pipeline_cases
from autoparallel.testing.launch import write_result
from trainer_real_runs import diff, run

ap.init_parallel_env()
FOUR, OUT = sys.argv[1], sys.argv[2]
STEPS = 4
RESUMES = {                           # name: (the 4-rank checkpoint (under OUT of that job), dp, tp, ZeRO stage here)
    "zero2 (dp 4) -> ZeRO-3 dp 2": ("zero/zero2/checkpoint-2", 2, 1, 3),
    "zero2 (dp 4) -> plain DP dp 2": ("zero/zero2/checkpoint-2", 2, 1, 0),
    "zero3 (dp 4) -> ZeRO-3 dp 2": ("zero/zero3/checkpoint-2", 2, 1, 3),
    "dp2 x tp2 x zero2 -> tp 2": ("zero/dp2_tp2_zero2/checkpoint-2", 1, 2, 0),
    "dp2 x tp2 (no ZeRO) -> ZeRO-2 dp 2": ("dist/checkpoint-2", 2, 1, 2),
}

out = {}
want = run(OUT, steps=STEPS)
for name, (saved, dp, tp, stage) in RESUMES.items():
    try:
        got = run(OUT, dp, tp, stage=stage, steps=STEPS, resume=os.path.join(FOUR, *saved.split("/")))
        out[name] = diff(got, want, tail=2)
    except Exception:                               # noqa: BLE001  (reported per case)
        out[name] = {"error": traceback.format_exc()[-3000:]}
for name, fn in trainer_pipeline_cases.TWO.items():
    try:
        out[name] = fn(OUT)
    except Exception:                               # noqa: BLE001  (reported per case)
        out[name] = {"error": traceback.format_exc()[-3000:]}
write_result({"rank": paddle.distributed.get_rank(), "cases": out})
