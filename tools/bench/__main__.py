"""``python -m tools.bench NAME [options]``: run one benchmark (see tools/bench/__init__.py)."""
import importlib
import sys

from tools.bench import BENCHMARKS


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        known = ", ".join(BENCHMARKS)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown benchmark {argv[0]!r}; expected one of: {known}", file=sys.stderr)
            return 2
        print(f"usage: python -m tools.bench NAME [options]\nbenchmarks: {known}")
        return 0
    module = importlib.import_module(f"tools.bench.{BENCHMARKS[argv[0]]}")
    sys.argv = [f"python -m tools.bench {argv[0]}", *argv[1:]]     # the benchmarks' own argparse reads these
    return module.main() or 0


if __name__ == "__main__":
    sys.exit(main())
