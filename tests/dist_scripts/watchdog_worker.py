"""4 real gloo ranks run a training-like loop (an all_reduce per step) under a Watchdog; at step 5 the victim
SIGKILLs or SIGSTOPs itself in the middle of its all_reduce. Every rank appends timestamped events to
OUT/rank<r>.jsonl (started, checkpoint, victim, failure with the watchdog's message, finished).
With CKPT_ROOT, the ranks first run the checkpoint checks of ckpt_checks.py (one launch serves both).
Usage: watchdog_worker.py MODE VICTIM OUT [CKPT_ROOT]   (MODE: kill | stop; AP_WATCHDOG_TIMEOUT: timeout)"""
import os
import signal
import sys
import time

import paddle
import paddle.distributed as dist

from autoparallel.testing import events
from autoparallel.watchdog import Watchdog

mode, victim, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ckpt_root = sys.argv[4] if len(sys.argv) > 4 else None
dist.init_parallel_env()
rank = dist.get_rank()


def note(kind, **fields):
    events.note(out, rank, kind, **fields)


if ckpt_root is not None:
    from ckpt_checks import checkpoint_round_trip, make_meshes

    meshes = make_meshes()                           # group creation first, as a training script does
wd = Watchdog(on_failure=lambda message: note("failure", message=message)).start()
note("started", interval=wd.interval, timeout=wd.timeout)
if ckpt_root is not None:
    note("checkpoint", result=checkpoint_round_trip(ckpt_root, rank, meshes))
x = paddle.ones([16])
for step in range(300):
    with wd.op("all_reduce", step=step):
        if rank == victim and step == 5:
            beats = wd.beats
            while wd.beats < beats + 2:              # a heartbeat published in this operation
                time.sleep(0.02)
            time.sleep(2 * wd.interval)             # ... and read by the others (they poll every interval)
            note("victim", signal=mode)
            os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        y = x.clone()
        dist.all_reduce(y)
    time.sleep(0.02)
note("finished")
wd.stop()
