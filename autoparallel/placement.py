"""Moved to ``autoparallel.core.placement``; this path stays importable and names the same module object."""
import sys

from autoparallel.core import placement as _moved

sys.modules[__name__] = _moved
