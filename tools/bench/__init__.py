"""The benchmarks: ``python -m tools.bench NAME [options]`` from the project root (``--help`` after a name
shows its options; no name lists them). Each writes its tables (and PNGs) under docs/ with the command.

Shared helpers (tables, medians, alternating rounds, launches on real ranks, progress bars, PNGs, the
commit measured): ``tools.bench.common``. The scripts run on every rank are ``tools/_bench_*_worker.py``,
launched as files; they import the installed package and, through the launch's ``PYTHONPATH``
(autoparallel/testing/launch.py: child_env), the project root the benchmark runs from.
"""
BENCHMARKS = {
    "reshard": "resharding",          # reshard transitions on 4 ranks vs paddle's reshard
    "dispatch": "dispatch",           # per-op dispatch overhead; GPT step vs paddle's semi-auto API
    "vs-paddle": "vs_paddle",         # GPT training step vs paddle's semi-auto API over layouts
    "memory": "memory",               # ZeRO stages and recompute: memory and step time
    "planner": "planner",             # planner speed and validation (docs/planner.md)
    "pipeline": "pipeline",           # pipeline schedules: step time and bubbles
    "static": "static",               # ap.to_static vs eager over layouts
    "predict": "predict",             # the planner's predicted step times vs measured ones
    "completion": "completion",       # static completion benchmark graphs and the tiny GPT
    "completion-time": "completion_time",  # completion's compile time against model depth, memos on and off
    "lazy-init": "lazy_init",         # lazy vs eager initialisation of a large model
    "comm-overhead": "comm_overhead",  # the transport's cost around a collective
    "profile-step": "profile_step",   # where a training step goes (ap.profile)
    "fused": "fused",                 # fused projections: block-sharded vs gathered outputs on real ranks
}
