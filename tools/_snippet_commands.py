"""The ``python ...`` command lines the docs show, and a check that their flags parse.

A command is checked by running its script (or module) with ``argparse.ArgumentParser.parse_args``
replaced by one that parses, prints ``FLAGS-OK`` and exits: the flags are checked by the script's own
parser and nothing else runs. ``paddle.distributed.launch`` is stripped (its own flags are paddle's);
``autoparallel SUB ...`` is the console script of ``autoparallel.cli``; a pytest command checks that
its test files exist.
"""
from __future__ import annotations

import glob
import os
import re
import shlex
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INLINE = re.compile(r"`([^`]*\bpython\b[^`]*)`")
START = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:\S*/)?(?:python3?|autoparallel (?:reshard|plan|calibrate|demo))\s")
# "...", NAME, FIRST LAST (two words in capitals stand for values), "[--flag", "a|b", this.py, a bare "python -m" / "-c"
PLACEHOLDER = re.compile(r"\.\.\.|\bNAME\b|\\\||\[--|\bthis\.py\b|^\S*python -[mc]$|\s[A-Z]{2,}\s+[A-Z]{2,}(?=\s|$)")
LAUNCH_VALUE_FLAGS = {"--nproc_per_node", "--nnodes", "--master", "--rank", "--log_dir", "--devices",
                      "--job_id", "--ips"}
RUNNER = """
import argparse, os, runpy, sys
_parse, _known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
_inside = []
def _check(self, args=None, namespace=None):
    _inside.append(1)
    _parse(self, args, namespace)
    print("FLAGS-OK", flush=True)
    os._exit(0)
def _check_known(self, args=None, namespace=None):
    if _inside:
        return _known(self, args, namespace)
    _known(self, args, namespace)
    print("FLAGS-OK", flush=True)
    os._exit(0)
argparse.ArgumentParser.parse_args = _check
argparse.ArgumentParser.parse_known_args = _check_known
def _reenter(path, argv, env=None):     # a shim that execs `python -m MODULE ...`: follow it in-process
    if len(argv) < 3 or argv[1] != "-m":
        print("EXEC " + " ".join(argv), flush=True)
        os._exit(3)
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    print("NO-PARSE", flush=True)
    os._exit(0)
for _name in ("execv", "execve"):
    setattr(os, _name, _reenter)
kind, target, *rest = sys.argv[1:]
sys.argv = [target, *rest]
if kind == "module":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    runpy.run_path(target, run_name="__main__")
print("NO-PARSE", flush=True)
"""


def _fence_commands(text: str) -> list:
    joined = re.sub(r"\\\n\s*", " ", text)
    return [ln.strip() for ln in joined.split("\n") if START.match(ln.strip())]


def _docstring_commands(path: str) -> list:
    """The command lines a script's module docstring shows (its usage)."""
    import ast
    doc = ast.get_docstring(ast.parse(open(path, encoding="utf-8").read())) or ""
    rel = os.path.relpath(path, ROOT)
    return [(rel, c) for c in _fence_commands(doc)]


def script_files(root: str = ROOT) -> list:
    """The examples and tools whose docstrings show how to run them."""
    return sorted(glob.glob(os.path.join(root, "examples", "*.py")) + glob.glob(os.path.join(root, "tools", "*.py"))
                  + glob.glob(os.path.join(root, "tools", "bench", "*.py")))


def command_lines(paths, extract) -> list:
    """[(where, command)] of every python / autoparallel command line in fences and inline code of markdown
    files (``extract(path)``: its fenced blocks), and in the module docstrings of python files."""
    out = []
    for path in paths:
        rel = os.path.relpath(path, ROOT)
        if path.endswith(".py"):
            out += _docstring_commands(path)
            continue
        for snip in extract(path):
            if snip.lang == "":
                out += [(f"{rel}:{snip.line}", c) for c in _fence_commands(snip.text)]
        fenced = False
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            fenced ^= line.lstrip().startswith("```")
            if not fenced and line.startswith("    ") and START.match(line.strip() + " "):
                out.append((f"{rel}:{n}", line.strip()))      # an indented code block
            for code in INLINE.findall(line):
                if START.match(code.strip() + " ") and not code.strip().startswith("pythonpath"):
                    out.append((f"{rel}:{n}", code.strip()))
    seen, unique = set(), []
    for where, cmd in out:
        cmd = re.sub(r"\s+#.*$", "", cmd).strip()
        if cmd not in seen and not PLACEHOLDER.search(cmd):
            seen.add(cmd)
            unique.append((where, cmd))
    return unique


def split_command(cmd: str) -> tuple:
    """(kind, target, args) of one command line: kind is 'module', 'path', 'pytest' or 'cli'."""
    words = [w for w in shlex.split(cmd) if not re.match(r"^[A-Z_]+=", w)]
    if os.path.basename(words[0]) == "autoparallel":
        return "module", "autoparallel.cli", words[1:]
    words = words[1:]
    if words[:2] == ["-m", "paddle.distributed.launch"]:
        words = words[2:]
        while words and words[0].startswith("--"):
            words = words[2:] if words[0] in LAUNCH_VALUE_FLAGS and "=" not in words[0] else words[1:]
        if words[1:2] == ["--"]:
            words = [words[0]] + words[2:]      # paddle's launch hands on what follows "--" unchanged
    if not words:
        return "none", "", []           # the launcher alone, named in a sentence
    if words[:2] == ["-m", "pytest"]:
        return "pytest", "", [w for w in words[2:] if w.startswith("tests")]
    if words[0] == "-m":
        return "module", words[1], words[2:]
    return "path", words[0], words[1:]


def check_command(cmd: str, timeout: float = 60):
    """None when the command's flags parse; else the reason."""
    kind, target, args = split_command(cmd)
    if kind == "none":
        return None
    if kind == "pytest":
        missing = [a for a in args if not os.path.exists(os.path.join(ROOT, a.split("::")[0]))]
        return f"no such test file: {missing}" if missing else None
    if kind == "path" and not os.path.exists(os.path.join(ROOT, target)):
        return f"no such script: {target}"
    if kind == "path" and "argparse" not in open(os.path.join(ROOT, target), encoding="utf-8").read():
        return None         # no parser to ask (a test module's table printer): running it is the whole job
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, kind, target, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)      # its own session: the script and whatever it started
        proc.communicate()
        return f"did not reach its argument parser within {timeout:.0f} s"
    if "FLAGS-OK" in out or proc.returncode == 0:
        return None     # the flags parsed, or a script without argparse ran to its end
    return (err.strip().splitlines() or [out.strip()[-200:] or f"exit code {proc.returncode}"])[-1]
