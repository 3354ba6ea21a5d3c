"""Moved to ``autoparallel.core.capabilities``; this path stays importable and names the same module object."""
import sys

from autoparallel.core import capabilities as _moved

sys.modules[__name__] = _moved
