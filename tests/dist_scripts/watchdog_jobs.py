"""The two real 4-rank gloo jobs of the test suite, launched once per pytest session and shared by
test_watchdog.py and test_checkpoint_dist.py:

* "kill": checkpoint checks (ckpt_checks.py), then a training loop in which rank 2 SIGKILLs itself;
* "stop": a training loop in which rank 0 (the host of the TCP store) SIGSTOPs itself.
"""
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from autoparallel.testing.events import events_of as read_events
from autoparallel.testing.launch import child_env

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "watchdog_worker.py")
TIMEOUT = 3.0                 # AP_WATCHDOG_TIMEOUT of the jobs
VICTIMS = {"kill": 2, "stop": 0}
# paddle 3.3.1's gloo sometimes fails the first new_group of a job on a loaded machine: such a job is run again
STARTUP_FLAKES = ("Connection refused", "Application timeout caused pair closure", "TIMEOUT self_rank")
_jobs: dict = {}


def events_of(out: str) -> dict:
    return read_events(out, 4)


def _reap(events: dict) -> None:
    """Never leave a stopped worker behind, whatever happened to the launcher."""
    for evs in events.values():
        for e in evs:
            try:
                with open(f"/proc/{e['pid']}/cmdline", "rb") as f:
                    if b"watchdog_worker.py" not in f.read():
                        continue
                os.kill(e["pid"], signal.SIGKILL)
            except OSError:
                pass


def job(mode: str, attempts: int = 3) -> dict:
    """Run (once) and return {"code", "events", "logs", "wall", "ckpt_root"} of the job ``mode``."""
    if mode in _jobs:
        return _jobs[mode]
    base = tempfile.mkdtemp(prefix=f"ap_wd_{mode}_")
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    for attempt in range(attempts):
        out, log = os.path.join(base, f"out{attempt}"), os.path.join(base, f"log{attempt}")
        ckpt_root = os.path.join(base, f"ckpt{attempt}")
        os.makedirs(out)
        env = child_env(dict(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOG_minloglevel="2",
                             FLAGS_call_stack_level="0", AP_WATCHDOG_TIMEOUT=str(TIMEOUT)))
        args = [mode, str(VICTIMS[mode]), out] + ([ckpt_root] if mode == "kill" else [])
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "4", "--log_dir", log,
               WORKER, *args]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=180)
        finally:
            events = events_of(out)
            _reap(events)
        logs = {}
        for r in range(4):
            path = os.path.join(log, f"workerlog.{r}")
            logs[r] = open(path, errors="replace").read() if os.path.exists(path) else ""
        started = [r for r in range(4) if any(e["kind"] == "started" for e in events.get(r, []))]
        errors = "".join(e["result"].get("error", "") for evs in events.values() for e in evs
                         if e["kind"] == "checkpoint")
        flake = "new_group" in errors and any(f in errors for f in STARTUP_FLAKES)
        if len(started) == 4 and not flake:    # else a gloo start-up failure: start the job again
            _jobs[mode] = {"code": proc.returncode, "events": events, "logs": logs,
                           "wall": time.monotonic() - start, "ckpt_root": ckpt_root,
                           "launcher": proc.stdout.decode(errors="replace")}
            return _jobs[mode]
    raise RuntimeError(f"the {mode} job did not start cleanly on 4 ranks in {attempts} attempts (started: "
                       f"{started}; gloo start-up failure: {flake})\n" + proc.stdout.decode(errors="replace")[-3000:])
