"""Which kind of test a test function is, from the code it runs: ``dist`` (starts processes: real ranks under
``paddle.distributed.launch``, a CLI in a subprocess), ``sim`` (runs ranks in this process with
``ap.simulate``), ``pure`` (neither).

The code a test runs is found statically: the test function's source, the fixtures it requests, and every
function or class (or table of them) it names that is defined in the test tree or ``tools/``, followed
through their own names in turn (``helpers.run`` of a helper module is followed to ``run``). A test naming
one of the package's own functions that start processes (``_package_launchers``) is ``dist`` too.
tests/conftest.py marks each collected test with its kind, so ``pytest -m "not dist"`` is the fast loop; a
module that sets ``pytestmark`` with one of the kinds keeps it.

tests/conftest.py checks the rule while tests run: a test not marked ``dist`` that starts a Python process
(``python_command``) fails at teardown, naming the command.
"""
from __future__ import annotations

import ast
import inspect
import os
import re
import sys
import textwrap
import types

KINDS = ("pure", "sim", "dist")
_DIST = re.compile(r"\blaunch\(|\bsubprocess\b|\bPopen\b|paddle\.distributed\.launch|\bmultiprocessing\b|\bos\.fork\(")
_SIM = re.compile(r"\bsimulate\(")
_CODE = (types.FunctionType, type, types.MethodType)


def kind_of_source(text: str) -> str:
    """The kind of one piece of source text alone."""
    if _DIST.search(text):
        return "dist"
    return "sim" if _SIM.search(text) else "pure"


def classify(fn, fixtures=(), roots=()) -> str:
    """The kind of test ``fn`` with fixture functions ``fixtures``; code is followed inside the directories
    ``roots`` (the directory of ``fn``'s file by default)."""
    roots = tuple(os.path.abspath(r) for r in roots) or (os.path.dirname(os.path.abspath(inspect.getfile(fn))),)
    launchers = _package_launchers()
    seen, todo, kinds = set(), [fn, *fixtures], set()
    while todo:
        obj = _unwrap(todo.pop())
        if obj in launchers:
            return "dist"
        if id(obj) in seen or not _inside(obj, roots):
            continue
        seen.add(id(obj))
        kind, named = _read(obj)
        kinds.add(kind)
        todo.extend(named)
    return "dist" if "dist" in kinds else "sim" if "sim" in kinds else "pure"


_READ: dict = {}        # id(obj) -> (obj, its own kind, the objects it names): a helper is read once per session


def _read(obj) -> tuple:
    """(kind of ``obj``'s own source, the objects its names refer to), cached: a collection classifies thousands of
    tests that share helpers, and reading source (inspect.getsource) is what costs."""
    hit = _READ.get(id(obj))
    if hit is None or hit[0] is not obj:
        text = _source(obj)
        hit = _READ[id(obj)] = (obj, kind_of_source(text), _named(obj, text))
    return hit[1], hit[2]


def _package_launchers() -> set:
    """The package's functions that start processes (and ``child_env``, which prepares one)."""
    from autoparallel import demo
    from autoparallel.planner import calibrate
    from autoparallel.testing import launch

    return {launch.launch, launch.run_job, launch.child_env, calibrate.run_ranks, calibrate.main, demo.main, demo.run_once}


def _unwrap(obj):
    obj = getattr(obj, "__wrapped__", obj)
    return getattr(obj, "__func__", obj)


def _inside(obj, roots) -> bool:
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        return False
    return bool(path) and any(os.path.abspath(path).startswith(r + os.sep) for r in roots)


def _source(obj) -> str:
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return ""


def _named(obj, text) -> list:
    """The objects the names in ``text`` refer to, in ``obj``'s module globals."""
    scope = getattr(obj, "__globals__", None)
    if scope is None:
        module = inspect.getmodule(obj)
        scope = vars(module) if module else {}
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            target = scope.get(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                isinstance(scope.get(node.value.id), types.ModuleType):
            target = getattr(scope[node.value.id], node.attr, None)
        else:
            continue
        items = target.values() if isinstance(target, dict) else target \
            if isinstance(target, (list, tuple, set, frozenset)) else [target]
        out.extend(t for t in items if isinstance(t, _CODE))      # a table of functions counts as its functions
    return out


def python_command(args) -> str | None:
    """``args`` of a ``subprocess.Popen`` as a short string when it starts a Python process, else None."""
    argv = [args] if isinstance(args, (str, bytes)) else list(args)
    if not argv:
        return None
    exe = os.path.basename(str(argv[0]).split()[0])
    if str(argv[0]) == sys.executable or exe.startswith("python"):
        return " ".join(map(str, argv))[:200]
    return None
