"""Moved to ``autoparallel.core.topology``; this path stays importable and names the same module object."""
import sys

from autoparallel.core import topology as _moved

sys.modules[__name__] = _moved
