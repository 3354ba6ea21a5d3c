"""Moved to ``autoparallel.reshard_exec``; this path stays importable and names the same module object."""
import sys

from autoparallel import reshard_exec as _moved

sys.modules[__name__] = _moved
