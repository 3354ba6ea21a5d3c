"""Draw a pipeline schedule timeline as a PNG and print its bubble fraction.

Planned (simulated) schedule:
    python tools/plot_schedule.py --schedule 1F1B --pp 4 --micro-batches 8 --out out/1f1b.png
    python tools/plot_schedule.py --schedule VPP --pp 4 --micro-batches 8 --vpp 2 --out out/vpp.png
Measured run (JSON list of [rank, kind, stage, microbatch, start, end] records):
    python tools/plot_schedule.py --records run.json --out out/measured.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from autoparallel.parallel.pipeline import SCHEDULES, bubble_formula, make_schedule
from autoparallel.parallel.pipeline.simulate import bubble_fraction
from autoparallel.parallel.pipeline.timeline import plot_schedule, plot_timeline


# the options of a planned schedule, with their defaults (None on the command line: "not given")
PLANNED = {"schedule": "1F1B", "pp": 4, "micro_batches": 8, "vpp": 1, "forward": 1.0, "backward": 2.0,
           "latency": 0.0}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", default=None, help=f"one of {', '.join(SCHEDULES)} (default 1F1B)")
    ap.add_argument("--pp", type=int, default=None, help="pipeline ranks (default 4)")
    ap.add_argument("--micro-batches", type=int, default=None, help="default 8")
    ap.add_argument("--vpp", type=int, default=None, help="virtual stages per rank (schedule VPP; default 1)")
    ap.add_argument("--forward", type=float, default=None,
                    help="forward time of one rank's share of the model (a VPP chunk takes 1/vpp of it; default 1)")
    ap.add_argument("--backward", type=float, default=None,
                    help="backward time per rank (ZB-H1 without --weight: split evenly into B and W; default 2)")
    ap.add_argument("--weight", type=float, default=None, help="weight-grad time (ZB-H1); B then takes --backward")
    ap.add_argument("--latency", type=float, default=None, help="send/recv latency (default 0)")
    ap.add_argument("--records", help="JSON file of measured [rank, kind, stage, microbatch, start, end] records")
    ap.add_argument("--title", default=None)
    ap.add_argument("--out", default="out/schedule.png")
    return ap


def unused_options(args) -> str:
    """Why the given options cannot all be honoured ('' when they can): a measured run takes no schedule
    options, and only ZB-H1 has a separate weight-gradient time."""
    if args.records:
        given = [n for n in (*PLANNED, "weight") if getattr(args, n) is not None]
        if given:
            return ("--records plots a measured run; the planned-schedule options "
                    + ", ".join("--" + n.replace("_", "-") for n in given) + " do not apply to it")
        return ""
    if args.weight is not None and (args.schedule or PLANNED["schedule"]) != "ZB-H1":
        return f"--weight is the weight-gradient time of ZB-H1, got schedule {args.schedule or PLANNED['schedule']!r}"
    return ""


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    ignored = unused_options(args)
    if ignored:
        ap.error(ignored)
    for name, value in PLANNED.items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.records:
        with open(args.records) as f:
            records = [tuple(r) for r in json.load(f)]
        plot_timeline(records, args.out, title=args.title or os.path.basename(args.records))
        print(f"measured bubble fraction: {bubble_fraction(records):.4f}")
    else:
        try:
            schedule = make_schedule(args.schedule, args.pp, args.micro_batches, args.vpp)
        except (ValueError, TypeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        v = schedule.vpp
        _, result = plot_schedule(schedule, args.out, title=args.title, forward=args.forward / v,
                                  backward=args.backward / v, weight=args.weight, latency=args.latency)
        print(f"{schedule.name} pp={args.pp} m={args.micro_batches} vpp={args.vpp}: "
              f"simulated bubble fraction {result.bubble_fraction:.4f} "
              f"(equal-stage formula {bubble_formula(schedule.name, args.pp, args.micro_batches, args.vpp):.4f}), "
              f"makespan {result.total_time:g}, peak in-flight micro-batches per rank {result.peak_inflight_rank}")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
