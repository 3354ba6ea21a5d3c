"""Runs on 2 ranks (tensor parallel over both): a rank-0-only evaluation forward that pairs silently with rank 1's
forward from another line (same sizes: the run would go on with wrong values), under the default-on collective
log (comm/collective_log.py).

* the negative control: training steps from one line, several heartbeats: the judge stays quiet;
* the divergence, then ``ap.save_state_dict`` on both ranks: refused at its entry, nothing written;
* the watchdog's judge names the mismatch on both ranks; the seconds from the divergence to the run's end.

The check runs on a watchdog of its own whose exit is recorded instead of ending the process (the launch goes on
with other jobs), on a log of its own; both forwards make the same collectives, so the group stays aligned.
Usage: collective_log_worker.py OUT_DIR
"""
import os
import sys
import time

import paddle
import paddle.distributed as dist

import autoparallel as ap
from autoparallel.comm import collective_log
from autoparallel.testing.launch import write_result
from autoparallel.watchdog import Watchdog

from rank_only_worker import batches, build, step

TIMEOUT = 3.0                       # the job's watchdog timeout: heartbeat interval 0.5 s


def evaluate(m, x):
    with paddle.no_grad():
        return m(paddle.to_tensor(x))           # rank 0's evaluation forward


def main():
    dist.init_parallel_env()
    rank, out_dir = dist.get_rank(), sys.argv[1]
    saved_log, collective_log.LOG = collective_log.LOG, collective_log.Log()
    exits, out = [], {}
    wd = Watchdog(timeout=TIMEOUT, rank=rank, world_size=2, collective_log=collective_log.LOG,
                  exit_fn=lambda code: exits.append((code, time.monotonic())), install_handlers=False,
                  namespace="ap_clog_job").start()
    try:
        m, opt = build(tp=2)
        data = batches()
        for x, y in data[:2]:
            step(m, opt, x, y)
        time.sleep(4 * wd.interval)                 # several heartbeats compared: equal logs pass
        out["quiet"] = {"exits": len(exits), "beats": wd.beats}
        dist.barrier()
        start = time.monotonic()
        if rank == 0:
            evaluate(m, data[2][0])
        else:
            with paddle.no_grad():
                m(paddle.to_tensor(data[2][0]))     # the same collective from another line: paired silently
        path = os.path.join(out_dir, "after_mismatch")
        try:
            ap.save_state_dict(m.state_dict(), path)
            out["save"] = {"error": None}
        except Exception as e:                       # noqa: BLE001  (reported to the test)
            out["save"] = {"error": f"{type(e).__name__}: {e}"}
        out["save"]["written"] = os.path.exists(path)
        while not exits and time.monotonic() - start < 6 * TIMEOUT:
            time.sleep(0.05)
        out["judged"] = {"exit": exits[0][0] if exits else None, "failure": wd.failure,
                         "seconds": exits[0][1] - start if exits else None, "interval": wd.interval}
        pending, collective_log._pending[0] = collective_log._pending[0], None
        out["pending"] = type(pending).__name__
    finally:
        wd.stop()
        collective_log.LOG = saved_log
        collective_log._pending[0] = None
    dist.barrier()
    write_result(out)


if __name__ == "__main__":
    main()
