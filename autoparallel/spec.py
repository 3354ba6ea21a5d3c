"""Moved to ``autoparallel.core.spec``; this path stays importable and names the same module object."""
import sys

from autoparallel.core import spec as _moved

sys.modules[__name__] = _moved
