"""Run a script on N real ranks with ``python -m paddle.distributed.launch`` and collect results.

Each rank writes ``$AP_RESULT_DIR/rank{r}.json`` (see ``write_result``); ``launch`` returns them in rank
order, or raises with the tail of every rank's log when the job fails or a rank wrote nothing.

The ranks import what the launching process imports: ``child_env`` puts this process's import-path entries
inside the project (the checkout holding the imported ``autoparallel``: its root, ``examples/``, ``tests/``
as pytest's ``pythonpath`` setting lists them) first on the children's ``PYTHONPATH``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# paddle 3.3.1's gloo sometimes refuses the connections of a new process group at start-up
# ("pair.cc ... connect ... Connection refused"), and on a loaded machine a rank that is still importing
# can miss gloo's fixed 30 s window ("TIMEOUT", "Application timeout caused pair closure"): such a
# job is started again, up to ``attempts`` times; a real hang fails every attempt.
STARTUP_FLAKES = ("Connection refused", "Application timeout caused pair closure", "TIMEOUT self_rank")


def child_env(env=None) -> dict:
    """``os.environ`` + ``env`` for a child process, with this process's project import paths on PYTHONPATH."""
    import autoparallel

    root = os.path.dirname(os.path.dirname(os.path.abspath(autoparallel.__file__)))
    here = [os.path.abspath(p or os.getcwd()) for p in sys.path]
    mine = [p for p in dict.fromkeys(here) if (p == root or p.startswith(root + os.sep))
            and not p.startswith(sys.prefix + os.sep) and os.path.isdir(p)]
    e = dict(os.environ)
    e.update(env or {})
    old = [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p and p not in mine]
    e["PYTHONPATH"] = os.pathsep.join(mine + old)
    return e


def launch(script: str, nproc: int, args=(), timeout: float = 600, env=None, nnodes: int = 1,
           attempts: int = 3) -> list:
    for attempt in range(attempts):
        job = run_job(script, nproc, args, timeout, env, nnodes)
        if job.ok:
            return job.results
        if not job.startup_flake:
            raise RuntimeError(job.failure())
        last = job.tails[-3000:]
    raise RuntimeError(f"{script}: gloo start-up failed {attempts} times\n{last}")


@dataclasses.dataclass
class Job:
    """The outcome of one launch: exit codes, each rank's result (None: it wrote none), the log tails."""
    script: str
    nproc: int
    codes: list
    results: list
    tails: str
    output: str
    stopped: str = None              # why the job was killed (a timeout), None if it ended by itself

    @property
    def ok(self) -> bool:
        return self.stopped is None and not any(self.codes) and all(x is not None for x in self.results)

    @property
    def startup_flake(self) -> bool:
        return self.stopped is None and any(f in self.tails for f in STARTUP_FLAKES)

    def failure(self) -> str:
        if self.stopped:
            return f"launch of {self.script} on {self.nproc} ranks {self.stopped}\n{self.tails}"
        return (f"launch of {self.script} on {self.nproc} ranks failed (exit codes {self.codes}, missing results "
                f"{[r for r, x in enumerate(self.results) if x is None]})\n{self.tails}\n{self.output}")


def run_job(script: str, nproc: int, args=(), timeout: float = 600, env=None, nnodes: int = 1, watch=None) -> Job:
    """One launch of ``script`` on ``nproc`` ranks, killed after ``timeout`` s or as soon as ``watch(result_dir)``
    (called every half second) returns a reason; the results the ranks wrote so far are returned either way."""
    workdir = tempfile.mkdtemp(prefix="ap_launch_")
    result_dir = os.path.join(workdir, "results")
    os.makedirs(result_dir)
    e = child_env({"OMP_NUM_THREADS": "1", "AP_RESULT_DIR": result_dir, "PYTHONUNBUFFERED": "1",
                   "GLOG_minloglevel": "2", "FLAGS_call_stack_level": "0", **(env or {})})
    logs, procs, outs = [], [], []
    master = f"127.0.0.1:{free_port()}"
    for node in range(nnodes):
        log = os.path.join(workdir, f"log{node}" if nnodes > 1 else "log")
        multi = ["--nnodes", str(nnodes), "--master", master, "--rank", str(node)] if nnodes > 1 else []
        cmd = [sys.executable, "-m", "paddle.distributed.launch", *multi, "--nproc_per_node", str(nproc // nnodes),
               "--log_dir", log, script, *map(str, args)]
        outs.append(open(os.path.join(workdir, f"launcher{node}.out"), "w+b"))
        procs.append(subprocess.Popen(cmd, env=e, stdout=outs[-1], stderr=subprocess.STDOUT))
        logs.append(log)
    try:
        stopped = _wait(procs, time.monotonic() + timeout, lambda: watch(result_dir) if watch else None)
    finally:                                    # also on KeyboardInterrupt: no rank outlives its test
        _stop(procs)
    stopped = stopped if stopped != "timeout" else f"timed out after {timeout} s"
    output = []
    for f in outs:
        f.seek(0)
        output.append(f.read().decode(errors="replace")[-2000:])
        f.close()
    results = [_read_json(os.path.join(result_dir, f"rank{r}.json")) for r in range(nproc)]
    return Job(script, nproc, [p.returncode for p in procs], results, _tails(logs), "\n".join(output), stopped)


def _wait(procs, deadline, check):
    """None once every process has ended; "timeout" past ``deadline``; ``check()``'s reason when it gives one."""
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            return "timeout"
        reason = check()
        if reason:
            return reason
        time.sleep(0.5)
    return None


def _stop(procs, grace: float = 15.0) -> None:
    """End launchers still running: SIGTERM first (paddle's launcher then stops its ranks), SIGKILL after
    ``grace`` s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _read_json(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _tails(log_dirs, n=3000) -> str:
    text = []
    for d in log_dirs:
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            if name.startswith("workerlog"):
                with open(os.path.join(d, name), errors="replace") as f:
                    text.append(f"--- {name} ---\n" + f.read()[-n:])
    return "\n".join(text)


_captured: list = []


@contextlib.contextmanager
def capture_results():
    """Inside, ``write_result`` appends its object to the list this yields instead of writing the rank's file
    (several test scripts run one after another in one launch: tests/dist_scripts/bundle_worker.py)."""
    got: list = []
    _captured.append(got)
    try:
        yield got
    finally:
        _captured.pop()


def write_result(obj) -> None:
    """Called on each rank: store this rank's JSON-serialisable result for ``launch``."""
    import paddle.distributed as dist

    if _captured:
        _captured[-1].append(obj)
        return
    d = os.environ.get("AP_RESULT_DIR")
    if not d:
        print(json.dumps(obj))
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = os.path.join(d, f".rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, os.path.join(d, f"rank{rank}.json"))


def run_jobs(run, jobs, stop_on_error: bool = False) -> dict:
    """Called on each rank: {job["name"]: run(job)} for every job; one that raises is reported as
    ``{"error": traceback}`` (also printed to stderr) and the next runs, or none does with ``stop_on_error``
    (after an error the ranks' communication sequences may differ)."""
    out = {}
    for job in jobs:
        try:
            out[job["name"]] = run(job)
        except Exception:                                   # noqa: BLE001  (reported to the test)
            out[job["name"]] = {"error": traceback.format_exc()}
            print(out[job["name"]]["error"], file=sys.stderr)
            if stop_on_error:
                break
    return out


def attempt(fn) -> str:
    """``fn()``'s outcome as a worker reports it: "ok", or the exception's type and message (a test checks them)."""
    try:
        fn()
        return "ok"
    except Exception as e:          # reported by type and message; the test checks them
        return f"{type(e).__name__}: {e}"
