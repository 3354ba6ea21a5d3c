"""What every benchmark shares: paths, tables, timing (medians, alternating rounds), launches on real ranks,
progress bars, PNG figures and the commit a result was measured at."""
from __future__ import annotations

import gc
import os
import statistics
import subprocess
import sys
import time

from reshard import units

fmt_bytes = units.fmt_bytes          # the one byte formatter (reshard/units.py)
TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TOOLS)


def tool(name: str) -> str:
    """The path of a script in tools/ (the private ``_..._worker.py`` scripts launched on every rank)."""
    return os.path.join(TOOLS, name)


# ---- tables -------------------------------------------------------------------------------------------------
def md_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def text_table(header, rows) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def median_ms(seconds) -> str:
    return f"{statistics.median(seconds) * 1e3:.0f}"


# ---- timing -------------------------------------------------------------------------------------------------
def timed_calls(fn, n) -> list:
    """Seconds of each of ``n`` calls of ``fn()``."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median_seconds(fn, n) -> float:
    return statistics.median(timed_calls(fn, n))


def alternating(items, rounds: int):
    """(round, item) for ``rounds`` rounds over ``items``, odd rounds in reverse order, so drift and
    background load hit every item alike."""
    for r in range(rounds):
        for item in (items if r % 2 == 0 else list(reversed(items))):
            yield r, item


def interleaved_medians(fns, warmup, max_repeats, rounds=10, budget=0.3) -> list:
    """Median microseconds of each function: warm-up, then ``rounds`` rounds that each time every function
    in turn; up to ``max_repeats`` calls each (at least 20), about ``budget`` seconds per function; the
    garbage collector off while timing (as timeit does)."""
    est = []
    for fn in fns:
        start = time.perf_counter()
        for _ in range(warmup):
            fn()
        est.append((time.perf_counter() - start) / max(warmup, 1))
    n = int(min(max_repeats, max(20, budget / max(max(est), 1e-9))))
    per_round = max(1, n // rounds)
    samples = [[] for _ in fns]
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for k, fn in enumerate(fns):
                samples[k] += timed_calls(fn, per_round)
    finally:
        gc.enable()
    return [statistics.median(s) * 1e6 for s in samples]


# ---- options --------------------------------------------------------------------------------------------------
GPT_ARGS = (("vocab", 1024), ("hidden", 256), ("layers", 4), ("heads", 8), ("seq", 128), ("batch", 8))


def add_int_args(parser, pairs) -> None:
    """``--name`` integer options with their defaults, from ``(name, default)`` pairs."""
    for name, default in pairs:
        parser.add_argument(f"--{name}", type=int, default=default)


def int_argv(args, names) -> list:
    """The command-line form of ``args``'s options ``names`` (to pass them on to a worker)."""
    return [x for n in names for x in (f"--{n}", str(getattr(args, n)))]


# ---- runs -----------------------------------------------------------------------------------------------------
def launch(script: str, nproc: int, args=(), **kw) -> list:
    """``script`` on ``nproc`` real ranks (autoparallel.testing.launch); each rank's reported result."""
    from autoparallel.testing.launch import launch as _launch

    return _launch(script, nproc, [str(a) for a in args], **kw)


def run_one(script: str, args=(), env=None, timeout: float = 900) -> dict:
    """``script`` in one process (no launcher) with the launch's environment; the result it reports."""
    import json
    import tempfile

    from autoparallel.testing.launch import child_env

    d = tempfile.mkdtemp(prefix="ap_bench_")
    e = child_env({"OMP_NUM_THREADS": "1", "AP_RESULT_DIR": d, "GLOG_minloglevel": "2", **(env or {})})
    proc = subprocess.run([sys.executable, script, *map(str, args)], env=e, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=timeout)
    path = os.path.join(d, "rank0.json")
    if proc.returncode or not os.path.exists(path):
        raise RuntimeError(f"{os.path.basename(script)} in one process failed ({proc.returncode}):\n"
                           f"{proc.stdout.decode(errors='replace')[-3000:]}")
    with open(path) as f:
        return json.load(f)


def progress(*args, **kw):
    """A tqdm progress bar on stderr (the tables go to stdout)."""
    from tqdm import tqdm

    return tqdm(*args, file=sys.stderr, **kw)


def save_png(fig, path: str, dpi: int = 110) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def git_commit() -> str:
    """The checked-out commit, marked when tracked files differ from it."""
    def git(*cmd):
        return subprocess.run(["git", "-C", ROOT, *cmd], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode:
        return "unknown"
    return f"`{head.stdout.strip()}`" + (" (with uncommitted changes)" if dirty else "")
