"""Old name of ``autoparallel.reshard_exec`` (the project says "reshard" for one concept); this path stays
importable and names the same module object, so patches of ``redistribute.execute`` reach every caller."""
import sys

from autoparallel import reshard_exec as _moved

sys.modules[__name__] = _moved
