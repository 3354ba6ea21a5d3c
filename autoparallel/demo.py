"""`autoparallel demo [--nproc 4] [--script PATH] [-- script args]`: launch a per-rank script on N CPU ranks.

Runs ``python -m paddle.distributed.launch --nproc_per_node N SCRIPT`` (gloo on CPU, OMP_NUM_THREADS=1 per
rank), streams rank 0's output, and exits non-zero if any rank fails. paddle 3.3.1's gloo sometimes refuses
a new process group's connections right after start-up; such a job is started once more.
The default script is examples/reshard_demo.py: reshards planned, explained, executed and verified.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

from autoparallel.testing.launch import STARTUP_FLAKES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SCRIPT = os.path.join(ROOT, "examples", "reshard_demo.py")

# launcher and library chatter hidden unless --verbose
_NOISE = [re.compile(p) for p in (
    r"^LAUNCH INFO ", r"^[IW]\d{4} \d\d:\d\d:\d\d", r"UserWarning: No ccache found", r"^\s+warnings\.warn\(",
    r"^=+( Modified FLAGS detected =+)?$", r"^FLAGS\(name=")]


MAX_RANKS = 256                 # processes one machine runs for a demo


def is_noise(line: str) -> bool:
    return any(p.search(line) for p in _NOISE)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="autoparallel demo", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks to launch on this machine (default 4)")
    p.add_argument("--script", default=DEFAULT_SCRIPT, help="per-rank script (default examples/reshard_demo.py)")
    p.add_argument("--timeout", type=float, default=300, help="seconds before the job is stopped (default 300)")
    p.add_argument("--verbose", action="store_true", help="also show the launcher's own output")
    args, rest = p.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if args.nproc < 1:
        p.error(f"--nproc expects a positive number of ranks, got {args.nproc}")
    if args.nproc > MAX_RANKS:
        p.error(f"--nproc {args.nproc} exceeds {MAX_RANKS} ranks on one machine")
    if not 0 < args.timeout < float("inf"):
        p.error(f"--timeout expects a positive number of seconds, got {args.timeout}")
    if not os.path.isfile(args.script):
        p.error(f"--script expects an existing file, got {args.script!r}")
    if rest and os.path.abspath(args.script) == os.path.abspath(DEFAULT_SCRIPT):
        p.error(f"the default script (examples/reshard_demo.py) takes no arguments, got {rest}; pass --script to "
                f"run a script that does")
    return args, rest


def main(argv=None) -> int:
    args, rest = parse_args(list(sys.argv[1:] if argv is None else argv))
    attempts = 3
    for attempt in range(1, attempts + 1):
        code, flake = run_once(args.script, args.nproc, rest, args.timeout, args.verbose)
        if not flake:
            return code
        if attempt < attempts:
            print("gloo failed while the ranks were starting up (a known paddle 3.3.1 flake: a refused "
                  "connection or a rank past the fixed 30 s window); starting the job again", file=sys.stderr)
    print(f"gloo start-up failed {attempts} times; giving up", file=sys.stderr)
    return code or 1


def launcher_safe(script_args) -> list:
    """paddle's launcher matches option prefixes even after the script name, so a script flag such as
    ``--auto`` (a prefix of its ``--auto_parallel_config``, ``--auto_cluster_config``...) aborts it as
    ambiguous; a ``--`` separator keeps the script's flags away from it (the examples drop the separator)."""
    if any(a.startswith("--auto") for a in script_args):
        return ["--", *script_args]
    return list(script_args)


def run_once(script, nproc, script_args, timeout, verbose) -> tuple:
    """Run the job once; returns (exit code, whether it failed with the gloo start-up flake)."""
    log_dir = tempfile.mkdtemp(prefix="ap_demo_")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOG_minloglevel="2")
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc), "--log_dir", log_dir,
           script, *launcher_safe(script_args)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    stopped = threading.Event()
    timer = threading.Timer(timeout, _stop, args=(proc, stopped))
    timer.start()
    try:
        for line in proc.stdout:               # paddle's launcher echoes rank 0's log
            if verbose or not is_noise(line):
                sys.stdout.write(line)
                sys.stdout.flush()
        code = proc.wait()
    finally:
        timer.cancel()
    if stopped.is_set():
        print(f"the job did not finish within {timeout:g} s and was stopped", file=sys.stderr)
    failed = _failed_ranks(log_dir, nproc)
    if code == 0 and not failed:
        shutil.rmtree(log_dir, ignore_errors=True)
        return 0, False
    if _flake_in(log_dir):
        shutil.rmtree(log_dir, ignore_errors=True)
        return code or 1, True
    print(f"\nthe job failed (launcher exit code {code}); worker logs are in {log_dir}", file=sys.stderr)
    for rank in failed or range(nproc):
        tail = _tail(os.path.join(log_dir, f"workerlog.{rank}"))
        if tail:
            print(f"--- rank {rank} (last lines of workerlog.{rank}) ---\n{tail}", file=sys.stderr)
    return code or 1, False


def _stop(proc, stopped):
    stopped.set()
    try:
        os.killpg(proc.pid, 9)                 # the launcher and the ranks it started
    except ProcessLookupError:
        pass


def _flake_in(log_dir) -> bool:
    text = "".join(_tail(os.path.join(log_dir, f), 4000) for f in os.listdir(log_dir) if f.startswith("workerlog"))
    return any(f in text for f in STARTUP_FLAKES)


def _failed_ranks(log_dir, nproc) -> list:
    """Ranks whose log shows a traceback."""
    return [r for r in range(nproc)
            if "Traceback (most recent call last)" in _tail(os.path.join(log_dir, f"workerlog.{r}"))]


def _tail(path, n=2500) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        lines = [ln for ln in f.read()[-n:].splitlines() if not is_noise(ln)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
