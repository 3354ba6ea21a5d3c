"""The Trainer's checkpoints under ZeRO on the 4 ranks of trainer_real_worker.py: for each layout, a run of 4 steps
saving every 2 (``save_steps``, the default flex format), then a new Trainer over a new model resuming from its
checkpoint-2 (``resume_from_checkpoint``) in the same processes. Each reports the saving run against one process,
the resumed run (its 2 logged losses, every parameter) against one process and against the saving run. The
control resumes the parameters without the optimizer states: it must end elsewhere. The
checkpoints are read again by trainer_resume2_worker.py (2 new processes, other layouts) and, in one process, by
tests/test_probe_trainer_real.py."""
import os

from trainer_real_runs import diff, run

STEPS = 4
LAYOUTS = {"zero1": (4, 1, 1), "zero2": (4, 1, 2), "zero3": (4, 1, 3), "dp2_tp2_zero2": (2, 2, 2)}   # dp, tp, stage
_ONE = []


def one(out):
    if not _ONE:
        _ONE.append(run(out, steps=STEPS))
    return _ONE[0]


def checkpoint(out, layout):
    return os.path.join(out, "zero", layout, "checkpoint-2")


def saved_and_resumed(layout):
    def case(out):
        dp, tp, stage = LAYOUTS[layout]
        saved = run(out, dp, tp, stage=stage, steps=STEPS, save_dir=os.path.join(out, "zero", layout), final=False)
        resumed = run(out, dp, tp, stage=stage, steps=STEPS, resume=checkpoint(out, layout))
        return {"saved": diff(saved, one(out)), "resumed": diff(resumed, one(out), tail=2),
                "resumed vs saved": diff(resumed, saved, tail=2)}

    return case


def control(out):
    """The resume with the optimizer states left out of the load (the parameters alone)."""
    from autoparallel import trainer_resume

    load = trainer_resume.load
    trainer_resume.load = lambda model, opt, path, with_optimizer=True: load(model, opt, path, with_optimizer=False)
    try:
        got = run(out, 4, 1, stage=2, steps=STEPS, resume=checkpoint(out, "zero2"))
    finally:
        trainer_resume.load = load
    return diff(got, one(out), tail=2)


CASES = {**{f"resume: {name}": saved_and_resumed(name) for name in LAYOUTS},
         "resume control: zero2 without the optimizer states": control}
