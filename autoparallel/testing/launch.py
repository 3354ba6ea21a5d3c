"""Run a script on N real ranks with ``python -m paddle.distributed.launch`` and collect results.

Each rank writes ``$AP_RESULT_DIR/rank{r}.json`` (see ``write_result``); ``launch`` returns them in rank
order, or raises with the tail of every rank's log when the job fails or a rank wrote nothing.

The ranks import what the launching process imports: ``child_env`` puts this process's import-path entries
inside the project (the checkout holding the imported ``autoparallel``: its root, ``examples/``, ``tests/``
as pytest's ``pythonpath`` setting lists them) first on the children's ``PYTHONPATH``.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
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
        try:
            return _launch_once(script, nproc, args, timeout, env, nnodes)
        except _StartupFlake as e:
            last = e
    raise RuntimeError(f"{script}: gloo start-up failed {attempts} times\n{last}")


class _StartupFlake(RuntimeError):
    pass


def _launch_once(script, nproc, args, timeout, env, nnodes) -> list:
    workdir = tempfile.mkdtemp(prefix="ap_launch_")
    result_dir = os.path.join(workdir, "results")
    os.makedirs(result_dir)
    e = child_env({"OMP_NUM_THREADS": "1", "AP_RESULT_DIR": result_dir, "PYTHONUNBUFFERED": "1",
                   "GLOG_minloglevel": "2", "FLAGS_call_stack_level": "0", **(env or {})})
    logs = []
    procs = []
    if nnodes == 1:
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
               "--log_dir", os.path.join(workdir, "log"), script, *map(str, args)]
        procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        logs.append(os.path.join(workdir, "log"))
    else:
        master = f"127.0.0.1:{free_port()}"
        for node in range(nnodes):
            log = os.path.join(workdir, f"log{node}")
            cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nnodes", str(nnodes), "--master", master,
                   "--rank", str(node), "--nproc_per_node", str(nproc // nnodes), "--log_dir", log,
                   script, *map(str, args)]
            procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
            logs.append(log)
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out.decode(errors="replace"))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"launch of {script} on {nproc} ranks timed out after {timeout} s\n" + _tails(logs))
    codes = [p.returncode for p in procs]
    results = []
    for r in range(nproc):
        path = os.path.join(result_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            results.append(None)
    if any(codes) or any(x is None for x in results):
        tails = _tails(logs)
        if any(f in tails for f in STARTUP_FLAKES):
            raise _StartupFlake(tails[-3000:])
        raise RuntimeError(f"launch of {script} on {nproc} ranks failed (exit codes {codes}, "
                           f"missing results {[r for r, x in enumerate(results) if x is None]})\n" + _tails(logs)
                           + "\n".join(o[-2000:] for o in outs))
    return results


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


def write_result(obj) -> None:
    """Called on each rank: store this rank's JSON-serialisable result for ``launch``."""
    import paddle.distributed as dist

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
