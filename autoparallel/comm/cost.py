"""Moved to ``autoparallel.core.cost``; this path stays importable and names the same module object."""
import sys

from autoparallel.core import cost as _moved

sys.modules[__name__] = _moved
