"""Moved to ``autoparallel.core.mesh``; this path stays importable and names the same module object."""
import sys

from autoparallel.core import mesh as _moved

sys.modules[__name__] = _moved
