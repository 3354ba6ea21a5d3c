import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_current_run():
    """Each test starts without a 'current run' left by another (the no-argument article calls act on it)."""
    mod = sys.modules.get("autoparallel.auto_checkpoint")
    if mod is not None:
        mod.reset()
    yield
