"""``python tools/bench_pipeline.py ARGS`` = ``python -m tools.bench pipeline ARGS`` (the command docs quote)."""
import os
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
os.execve(sys.executable, [sys.executable, "-m", "tools.bench", "pipeline", *sys.argv[1:]], env)
