"""`autoparallel plan | reshard | calibrate | demo` — each subcommand lives in its own module."""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module with main(argv) -> int, one-line help)
COMMANDS = {
    "reshard": ("reshard.cli", "plan and explain a redistribution: --shape --mesh --from --to"),
    "plan": ("autoparallel.planner.cli", "choose a parallel strategy for a model on a cluster"),
    "calibrate": ("autoparallel.planner.calibrate", "measure gloo collectives on real ranks, per-op costs and compute "
                                                    "into a cluster profile JSON"),
    "demo": ("autoparallel.demo", "launch the multi-rank CPU demo"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: autoparallel {" + ",".join(COMMANDS) + "} ...\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<10} {text}")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"autoparallel: unknown command {cmd!r}; expected one of {sorted(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[cmd][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
