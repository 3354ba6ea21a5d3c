"""Moved to ``autoparallel.core.cluster``; this path stays importable and names the same module object."""
import sys

from autoparallel.core import cluster as _moved

sys.modules[__name__] = _moved
