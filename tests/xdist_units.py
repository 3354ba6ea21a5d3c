"""How ``make test`` (pytest-xdist, ``--dist loadscope``, two workers) cuts the suite into units, and their order.

- A test that reads a shared real-rank job's results (``dist_scripts/shared_launch.py``) is in the one unit
  "shared launches", so one worker makes each world size's one launch (and a job reading another size's output
  finds it). Which tests those are is read from the module's text (the controller imports no test module): a
  function reads the results if its source names ``shared_launch`` or a module-level function (fixture or
  helper) that does, transitively; an autouse fixture or ``usefixtures`` that does puts the whole module there.
- Every other test of such a module (its in-process checks) is in its module's own unit, like any other module,
  and goes to whichever worker is free: the worker making the launches is not left alone with them at the end.
- Units start costliest first (``unit_seconds.json``: one measured run's seconds per module of 5 s or more;
  0.3 s a test for a module not recorded), so no long module is left for the end while the other worker idles.
"""
from __future__ import annotations

import ast
import functools
import json
import os

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
SHARED = "shared launches"
ALL = "*"                       # every test of the module reads the shared results


def scope(nodeid: str) -> str:
    path, _, rest = nodeid.partition("::")
    readers = shared_readers(path)
    if not readers:
        return path
    name = rest.split("::")[-1].split("[", 1)[0]
    return SHARED if ALL in readers or name in readers else path


@functools.lru_cache(maxsize=None)
def shared_readers(path: str) -> frozenset:
    """Names of the module's functions that read a shared job's results (``{ALL}``: every test; empty: the
    module declares no shared job)."""
    full = os.path.join(ROOT, path)
    if not path.endswith(".py") or not os.path.exists(full):
        return frozenset()
    with open(full) as f:
        text = f.read()
    if "shared_launch.job(" not in text:
        return frozenset()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return frozenset({ALL})
    if "usefixtures" in text:
        return frozenset({ALL})
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    uses = {f.name: set() for f in funcs}
    direct = set()
    for f in funcs:
        names = {n.id for n in ast.walk(f) if isinstance(n, ast.Name)}
        names |= {a.arg for a in ast.walk(f.args) if isinstance(a, ast.arg)}
        uses[f.name] |= names
        if "shared_launch" in names:
            direct.add(f.name)
    readers = set(direct)
    while True:
        more = {name for name, names in uses.items() if name not in readers and names & readers}
        if not more:
            break
        readers |= more
    if any(f.name in readers and _autouse(f) for f in funcs):
        return frozenset({ALL})
    return frozenset(readers)


def _autouse(f) -> bool:
    return any(isinstance(d, ast.Call) and any(k.arg == "autouse" for k in d.keywords) for d in f.decorator_list)


@functools.lru_cache(maxsize=None)
def _recorded_seconds() -> dict:
    with open(os.path.join(TESTS, "unit_seconds.json")) as f:
        return json.load(f)


def cost(nodeids) -> float:
    """A unit's expected seconds: its modules' recorded seconds, 0.3 s a test for a module not recorded."""
    per_module: dict = {}
    for nodeid in nodeids:
        path = nodeid.split("::", 1)[0]
        per_module[path] = per_module.get(path, 0) + 1
    return sum(_recorded_seconds().get(path, 0.3 * n) for path, n in per_module.items())
