"""The command-line flags of the training examples (train_gpt.py, train_llama.py) and the refusals made before
any work: a strategy the world cannot honour, a pipeline schedule without stages, strategy flags beside ``--auto``,
checkpoint flags without a checkpoint directory."""
from __future__ import annotations

import argparse

from autoparallel.strategy import Strategy, add_strategy_args
from models import PRESETS


def make_parser(default_model: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=f"train a byte-level {default_model} on the Python stdlib sources")
    add_strategy_args(p)
    p.add_argument("--model", default=default_model, choices=sorted(PRESETS), help="model preset")
    p.add_argument("--steps", type=_positive, default=20, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the data order")
    p.add_argument("--batch-size", dest="batch_size", type=_positive, default=8, help="global batch size (samples)")
    p.add_argument("--seq-len", dest="seq_len", type=_positive, default=16, help="tokens (bytes) per sample")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--log-json", dest="log_json", default=None, help="write the run log here (rank 0)")
    p.add_argument("--static", action="store_true", help="captured-graph mode: ap.to_static with completed layouts")
    p.add_argument("--ckpt-dir", dest="ckpt_dir", default=None, help="save distributed checkpoints here")
    p.add_argument("--save-every", dest="save_every", type=_positive, default=None,
                   help=f"steps between checkpoints (needs --ckpt-dir; default {SAVE_EVERY})")
    p.add_argument("--resume", action="store_true", help="resume from the newest complete checkpoint in --ckpt-dir")
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="profile the last step: print its per-rank breakdown, save stacked bars to PATH (.png)")
    p.add_argument("--no-watchdog", dest="watchdog", action="store_false",
                   help="do not start the watchdog that names a lost or frozen rank in seconds (same as "
                        "AP_WATCHDOG=off)")
    return p


SAVE_EVERY = 10
# the strategy flags --auto leaves to the planner, with their values when not given
PLANNED_FLAGS = {"dp": None, "tp": 1, "pp": 1, "sp": False, "sharding_stage": 0, "offload": False,
                 "recompute": "none", "grad_accum": 1, "micro_batches": None, "schedule": None, "vpp": None}


def check_args(parser: argparse.ArgumentParser, args, world: int) -> None:
    """Refuse (exit 2, naming the flag) what this run cannot honour, before any work: a strategy invalid
    for the world size (``--offload`` without sharding, ``--vpp`` or ``--micro-batches`` without ``--pp``,
    degrees that do not multiply to the world, ...), a ``--schedule`` with one pipeline stage, strategy
    flags next to ``--auto`` (the planner chooses them), and checkpoint flags without ``--ckpt-dir`` or
    with ``--static``."""
    if args.resume and not args.ckpt_dir:
        parser.error("--resume needs --ckpt-dir (where the checkpoints are)")
    if args.save_every is not None and not args.ckpt_dir:
        parser.error(f"--save-every {args.save_every} needs --ckpt-dir (where the checkpoints go)")
    if args.static and args.ckpt_dir:
        parser.error("--ckpt-dir (with --save-every/--resume) is not supported with --static: the captured-graph "
                     "run saves no checkpoints; drop one of them")
    if args.auto:
        given = ["--" + k.replace("_", "-") for k, unset in PLANNED_FLAGS.items() if getattr(args, k) != unset]
        if given:
            parser.error(f"--auto lets the planner choose the strategy; {', '.join(given)} would be ignored: "
                         f"drop them, or drop --auto to set the strategy yourself")
        return
    if args.schedule is not None and args.pp == 1:
        parser.error(f"--schedule {args.schedule} needs --pp > 1 (got --pp 1): a schedule orders pipeline stages")
    try:
        Strategy.from_args(args).validate(world_size=world)
    except (ValueError, TypeError) as e:
        where = "the single-process run" if world == 1 else f"this {world}-rank run"
        parser.error(f"{where} cannot honour these flags: {e}")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)
