"""``python tools/bench_fused.py ARGS`` = ``python -m tools.bench fused ARGS`` (the command docs quote)."""
import os
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
os.execve(sys.executable, [sys.executable, "-m", "tools.bench", "fused", *sys.argv[1:]], env)
