"""The planner is pure: its modules, the cluster spec and the collective cost formulas import and plan with
paddle unavailable (the package's ``__init__`` installs runtime hooks, so the child process loads the
subpackages from the package directory without running it)."""
import os
import subprocess
import sys

import autoparallel

PKG = os.path.dirname(autoparallel.__file__)
CHILD = r"""
import importlib, sys, types
pkg = types.ModuleType("autoparallel"); pkg.__path__ = [sys.argv[1]]
sys.modules["autoparallel"] = pkg
sys.modules["paddle"] = None                      # any import of paddle raises ImportError
for name in sys.argv[2:]:
    importlib.import_module(name)
from autoparallel.planner.api import plan
from autoparallel.planner.published import RUNS, validation_table
best = plan("llama2-7b", "2x8:A100-80GB", global_batch_size=64, seq_len=2048).best
rows = validation_table(RUNS[:2])
print("OK", best.config.short(), len(rows), "paddle" in sys.modules and sys.modules["paddle"] is not None)
"""
MODULES = ["autoparallel.planner." + f[:-3] for f in sorted(os.listdir(os.path.join(PKG, "planner")))
           if f.endswith(".py") and f != "__init__.py"] + ["autoparallel.comm.cost", "autoparallel.comm.capabilities"]


def test_planner_imports_and_plans_without_paddle():
    out = subprocess.run([sys.executable, "-c", CHILD, PKG] + MODULES, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("OK ") and out.stdout.split()[-1] == "False", out.stdout


def test_blocked_paddle_is_detected():
    """Negative control: the same child importing a module that needs paddle fails."""
    out = subprocess.run([sys.executable, "-c", CHILD, PKG, "autoparallel.dist_tensor"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "paddle" in out.stderr
