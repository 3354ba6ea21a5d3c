"""``python tools/bench_comm_overhead.py ARGS`` = ``python -m tools.bench comm-overhead ARGS`` (the command docs quote)."""
import os
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
os.execve(sys.executable, [sys.executable, "-m", "tools.bench", "comm-overhead", *sys.argv[1:]], env)
