"""``python tools/bench_completion.py ARGS`` = ``python -m tools.bench completion ARGS`` (the command docs quote)."""
import os
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
os.execve(sys.executable, [sys.executable, "-m", "tools.bench", "completion", *sys.argv[1:]], env)
