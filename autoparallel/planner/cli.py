"""``autoparallel plan``: choose or evaluate a parallel configuration from the command line.

Exit codes: 0 a plan fits; 1 the request is infeasible (the message names the smallest change that
fits); 2 bad input (unknown model or cluster, malformed --fixed, indivisible batch, zero devices).
"""
from __future__ import annotations

import argparse
import sys

from autoparallel.cli_checks import (MAX_DEVICES, MAX_GLOBAL_BATCH, MAX_SEQ_LEN, MAX_TOKENS, bounded,
                                     output_path)
from autoparallel.planner.model_spec import PRESETS, parse_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autoparallel plan",
        description="Rank DP/TP/PP/VPP/SP/ZeRO/recompute/offload/micro-batch configurations of a model on a "
                    "cluster by predicted step time, or evaluate one fixed configuration.")
    p.add_argument("--model", required=True,
                   help=f"preset ({', '.join(sorted(PRESETS))}) or 'hidden=8192,layers=48,heads=64,vocab=51200"
                        f"[,ffn=...,kv_heads=...,swiglu=1]'")
    p.add_argument("--cluster", required=True,
                   help="NODESxGPUS:TYPE (e.g. 128x8:A100-80GB) or a profile .json written by 'autoparallel calibrate'")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--top", type=int, default=5, help="candidates to show (default 5)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--fixed", default=None,
                   help="evaluate one configuration, e.g. 'dp=4,tp=8,pp=4,micro_batch=1,recompute=selective,"
                        "sharding=1' (keys: dp tp pp vpp sp sharding offload micro_batch recompute ep "
                        "split=even|ends|balanced dualpipe=0|1)")
    p.add_argument("--plot", default=None, metavar="PNG", help="save the memory breakdown and step times as a PNG")
    p.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                   help="numerics (default: bf16, or the profile's precision)")
    p.add_argument("--flash-attention", action="store_true", help="attention scores are never materialised")
    return p


PLOT_SUFFIXES = ("png", "pdf", "svg", "jpg", "jpeg")


def check_args(args) -> None:
    """Sizes no cluster has and an unwritable --plot are refused before any work."""
    bounded("--global-batch", args.global_batch, MAX_GLOBAL_BATCH, "sequences per step")
    if args.seq_len is not None:
        bounded("--seq-len", args.seq_len, MAX_SEQ_LEN, "tokens per sequence")
        bounded("--global-batch x --seq-len", args.global_batch * args.seq_len, MAX_TOKENS, "tokens per step")
    bounded("--top", args.top, 10 ** 6, "candidates")
    if args.plot:
        output_path("--plot", args.plot, PLOT_SUFFIXES)


MODEL_BOUNDS = {"hidden": 2 ** 24, "ffn": 2 ** 26, "layers": 2 ** 16, "heads": 2 ** 16, "kv_heads": 2 ** 16,
                "vocab": 2 ** 30, "seq_len": MAX_SEQ_LEN}


def check_model(text: str):
    """The ModelSpec of --model, its sizes bounded (no model has more)."""
    model = parse_model(text)
    for field, high in MODEL_BOUNDS.items():
        value = getattr(model, field, 0) or 0
        if value > high:
            raise ValueError(f"--model {field}={value} exceeds {high:,}, more than any model has")
    return model


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:            # argparse already printed usage and the error on stderr
        return int(exc.code or 0)
    from autoparallel.planner.api import plan
    from autoparallel.core.cluster import parse_cluster
    from autoparallel.planner.options import options_for_cluster
    try:
        check_args(args)
        model = check_model(args.model)
        cluster = parse_cluster(args.cluster)
        bounded("--cluster", cluster.world_size, MAX_DEVICES, "devices")
        options = options_for_cluster(cluster)
        changes = {}
        if args.precision:
            changes["precision"] = args.precision
        if args.flash_attention:
            changes["flash_attention"] = True
        options = options.replace(**changes) if changes else options
        result = plan(model, cluster, global_batch_size=args.global_batch, seq_len=args.seq_len,
                      top=args.top, fixed=args.fixed, options=options)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"autoparallel plan: error: {message}", file=sys.stderr)
        return 2
    if args.json:
        print(result.to_json())
    elif result.feasible:
        print(result)
    if not result.feasible:
        print(result.explanation, file=sys.stderr)
        return 1
    if args.plot:
        from autoparallel.planner.plot import plot_plan
        plot_plan(result, args.plot)
        if not args.json:
            print(f"\nplot saved to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
