"""Real-rank test jobs that share one launch per world size (process start-up is most of a small job's time).

A test module declares its job when it is imported, ``JOB = shared_launch.job(__name__, "name", script, nproc)``
(pytest imports every collected module before running any test). The first test asking for a job's
``results(JOB)`` launches, once, every declared job of that world size whose module has a selected test, one after
another on the same ranks (bundle_worker.py); ``pytest tests/test_x.py`` launches only that module's jobs.
Each job keeps its own deadline (``timeout``, counted from when its first rank starts it); a job that fails or
overruns gets its own error (its ranks' tracebacks and log tails), and the jobs after it run again in a new
launch, so one broken job costs the others one more start-up and nothing else.

Import this module as ``from dist_scripts import shared_launch`` only (one registry per session).
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import tempfile
import time

from autoparallel.testing.launch import STARTUP_FLAKES, run_job

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bundle_worker.py")
ATTEMPTS = 3                        # a job that fails on a gloo start-up flake is started again, as launch() does
_declared: dict = {}                # name -> Job, in declaration order
_outcome: dict = {}                 # name -> (out dir, per-rank results) or the error text
_selected = {"modules": None}       # module names with a selected test (conftest); None: only the asked job
timings: dict = {}                  # name -> seconds its slowest rank spent in it (which job costs what)
cpu_timings: dict = {}              # name -> CPU seconds of all its ranks together (what it takes from the machine)
launches: list = []                 # (ranks, jobs in it, wall seconds) of every launch made


@dataclasses.dataclass(eq=False)
class Job:
    module: str
    name: str
    script: str
    nproc: int
    args: object = ()               # a list, or a callable(out_dir) -> list (it may write files the job reads)
    env: object = None              # a dict, or a callable(out_dir) -> dict
    timeout: float = 400.0
    after: tuple = ()               # jobs (of other world sizes) whose outputs this one reads: they run first
    first: bool = False             # run at the start of its launch (its cost grows with what earlier jobs loaded)


def job(module: str, name: str, script: str, nproc: int, args=(), env=None, timeout: float = 400.0,
        after=(), first: bool = False) -> Job:
    if name in _declared and _declared[name].module != module:
        raise ValueError(f"shared job name {name!r} is declared by {_declared[name].module} and {module}")
    _declared[name] = Job(module, name, script, nproc, args, env, timeout, tuple(after), first)
    return _declared[name]


def results(one: Job):
    """(``one``'s output directory, each rank's ``write_result`` object in rank order), launching first if needed."""
    if one.name not in _outcome:
        bundle = [j for j in _declared.values() if j.nproc == one.nproc and j.name not in _outcome
                  and (j is one or _wanted(j))]
        for dep in {d.name: d for j in bundle for d in j.after if d.name not in _outcome}.values():
            if dep.nproc == one.nproc:
                raise ValueError(f"shared job {one.name!r}: a job it runs after must have another world size "
                                 f"(jobs of one size run in declaration order), got {dep.name!r}")
            results_or_error(dep)
        _run_bundle(sorted(bundle, key=lambda j: not j.first))
    got = _outcome[one.name]
    if isinstance(got, str):
        raise RuntimeError(got)
    return got


def results_or_error(one: Job):
    """``results(one)``, or the error text if it failed."""
    try:
        return results(one)
    except RuntimeError as e:
        return str(e)


def select_modules(names) -> None:
    """Called by conftest once collection is final: the modules whose jobs the shared launches run."""
    _selected["modules"] = set(names)


def _wanted(j: Job) -> bool:
    return _selected["modules"] is not None and j.module in _selected["modules"]


def _run_bundle(jobs: list) -> None:
    base = tempfile.mkdtemp(prefix="ap_shared_")
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    tries = {j.name: 0 for j in jobs}          # launches each job was in (its output directory's suffix)
    flakes = {j.name: 0 for j in jobs}         # gloo start-up failures met by each
    pending = list(jobs)
    while pending:
        spec, outs = _spec(pending, base, tries)
        pending = [j for j in pending if j.name in outs]
        if not pending:
            return
        path = os.path.join(base, f"bundle{len(os.listdir(base))}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        watch, start = _Deadlines(pending), time.monotonic()
        res = run_job(WORKER, pending[0].nproc, [path], timeout=sum(j.timeout for j in pending) + 60, watch=watch)
        launches.append((pending[0].nproc, len(pending), time.monotonic() - start))
        pending = _collect(pending, res, outs, flakes)


def _spec(pending, base, tries):
    spec, outs = [], {}
    for j in pending:
        tries[j.name] += 1
        outs[j.name] = os.path.join(base, f"{j.name}.{tries[j.name]}")
        os.makedirs(outs[j.name])
        try:
            args = j.args(outs[j.name]) if callable(j.args) else j.args
            env = j.env(outs[j.name]) if callable(j.env) else j.env
        except Exception as e:                 # noqa: BLE001  (e.g. a job it runs after failed)
            _outcome[j.name] = f"shared launch job {j.name!r}: preparing its arguments failed: {e!r}"
            del outs[j.name]
            continue
        spec.append({"name": j.name, "script": j.script, "args": [str(a) for a in args], "env": env or {}})
    return spec, outs


def _collect(pending, res, outs, flakes) -> list:
    """Record every job the ranks finished; the first unfinished one failed: its error (or another attempt on a
    gloo start-up flake); the jobs after it are returned to run in a new launch."""
    ranks = [r or {"done": {}} for r in res.results]
    for i, j in enumerate(pending):
        if all(j.name in r["done"] for r in ranks):
            _outcome[j.name] = (outs[j.name], [r["done"][j.name] for r in ranks])
            timings[j.name] = max(r.get("seconds", {}).get(j.name, 0.0) for r in ranks)
            cpu_timings[j.name] = sum(r.get("cpu", {}).get(j.name, 0.0) for r in ranks)
            continue
        errors = "".join(f"--- rank {n}: {r['error']}" for n, r in enumerate(ranks) if r.get("failed") == j.name)
        # a traceback of the job's own is its failure (its peers' logs then show gloo losing that rank)
        flake = any(f in errors for f in STARTUP_FLAKES) if errors else res.startup_flake
        flakes[j.name] += flake
        if flake and flakes[j.name] < ATTEMPTS:
            return pending[i:]
        _outcome[j.name] = (f"shared launch job {j.name!r} ({j.script}) on {j.nproc} ranks did not finish: "
                            f"{res.stopped or 'a rank failed'}\n{errors}\n{res.failure()}")
        return pending[i + 1:]
    return []


class _Deadlines:
    """``run_job``'s watch: a reason to stop the launch once a job has run past its own timeout, counted from
    when its first rank started it (the first job's from the launch)."""

    def __init__(self, jobs):
        self.jobs = jobs
        self.started = {0: time.monotonic()}

    def __call__(self, result_dir):
        at = [self._index(result_dir, r) for r in range(self.jobs[0].nproc)]
        now = time.monotonic()
        for k in range(1, max(at) + 1):
            self.started.setdefault(k, now)
        k = min(at)
        if k < len(self.jobs) and now - self.started[k] > self.jobs[k].timeout:
            return f"stopped: job {self.jobs[k].name!r} ran past its {self.jobs[k].timeout:g} s"
        return None

    @staticmethod
    def _index(result_dir, rank) -> int:
        try:
            with open(os.path.join(result_dir, f"progress.rank{rank}")) as f:
                return int(f.read() or 0)
        except (OSError, ValueError):
            return 0
