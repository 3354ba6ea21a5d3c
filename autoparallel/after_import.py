"""Run a function as soon as a named module's import ends (the module may be imported after autoparallel
patched paddle: PaddleFormers' Trainer module, say). A finder at the head of ``sys.meta_path`` wraps that
module's loader once; ``patches.undo()`` removes the finder and the pending calls."""
from __future__ import annotations

import importlib.abc
import sys

from autoparallel import patches

_PENDING: dict = {}            # module name -> [callables]


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name: str):
        self._inner, self._name = inner, name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        for fn in _PENDING.pop(self._name, []):
            fn()

    def __getattr__(self, attr):                  # get_source, is_package, ... (tracebacks, inspect)
        return getattr(self._inner, attr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, name)
                return spec
        return None


_FINDER = _Finder()


def watch(name: str, fn) -> None:
    """Call ``fn()`` once when module ``name`` finishes importing; nothing when it is already in
    ``sys.modules`` (imported, or being imported: the caller looks there itself)."""
    if name in sys.modules:
        return
    calls = _PENDING.setdefault(name, [])
    if fn not in calls:
        calls.append(fn)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def _reset() -> None:
    _PENDING.clear()
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


patches.on_undo(_reset)
