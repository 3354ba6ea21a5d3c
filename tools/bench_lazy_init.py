"""``python tools/bench_lazy_init.py ARGS`` = ``python -m tools.bench lazy-init ARGS`` (the command docs quote)."""
import os
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
os.execve(sys.executable, [sys.executable, "-m", "tools.bench", "lazy-init", *sys.argv[1:]], env)
