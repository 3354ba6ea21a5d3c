"""Strategy flags shared by the training scripts: ``add_strategy_args`` and ``Strategy.from_args``."""
from __future__ import annotations

import argparse

from autoparallel.config.sections import SCHEDULES


class CliMixin:
    """``Strategy.from_args``."""

    @classmethod
    def from_args(cls, args: argparse.Namespace):
        """A Strategy from the flags added by ``add_strategy_args`` (missing or None attributes keep defaults).

        ``args.seed`` is read too when the script defines it.
        """
        def arg(name, default=None):
            v = getattr(args, name, None)
            return default if v is None else v

        s = cls()
        if arg("auto", False):
            s.auto_mode = "full"
        s.data_parallel.degree = arg("dp")
        s.tensor_parallel.degree = arg("tp", 1)
        s.pipeline_parallel.degree = arg("pp", 1)
        s.sequence_parallel.enable = bool(arg("sp", False))
        stage = arg("sharding_stage", 0)
        if stage:
            s.sharding.enable = True
            s.sharding.stage = stage
        s.sharding.offload = bool(arg("offload", False))
        recompute = arg("recompute", "none")
        if recompute != "none":
            s.recompute.enable = True
            s.recompute.granularity = recompute
        amp = arg("amp", "none")
        if amp != "none":
            s.amp.enable = True
            s.amp.dtype = amp
        s.gradient_accumulation_steps = arg("grad_accum", 1)
        s.pipeline_parallel.micro_batches = arg("micro_batches")
        schedule = arg("schedule")
        vpp = arg("vpp", 2 if schedule == "VPP" else 1)         # --schedule VPP alone: 2 virtual stages
        s.pipeline_parallel.vpp_degree = vpp
        if schedule or vpp > 1:                  # no --schedule: left at its default (schedule_chosen() stays False)
            s.pipeline_parallel.schedule = schedule or "VPP"
        s.seed = arg("seed")
        return s


def add_strategy_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the strategy flags shared by the training examples; read them back with ``Strategy.from_args``."""
    g = parser.add_argument_group("parallel strategy")
    g.add_argument("--dp", type=_positive, default=None, help="data-parallel degree (default: world // (tp*pp))")
    g.add_argument("--tp", type=_positive, default=1, help="tensor-parallel degree")
    g.add_argument("--pp", type=_positive, default=1, help="pipeline stages")
    g.add_argument("--sp", action="store_true", help="sequence parallel inside the tensor-parallel group")
    g.add_argument("--sharding-stage", dest="sharding_stage", type=int, choices=(0, 1, 2, 3), default=0,
                   help="ZeRO stage over the data axis (0: off)")
    g.add_argument("--offload", action="store_true", help="keep optimizer states in host memory (needs sharding)")
    g.add_argument("--recompute", choices=("none", "full", "selective"), default="none", nargs="?", const="full",
                   help="activation recompute (a bare --recompute means full)")
    g.add_argument("--amp", choices=("none", "bfloat16", "float16"), default="none", help="mixed precision dtype")
    g.add_argument("--grad-accum", dest="grad_accum", type=_positive, default=1,
                   help="gradient accumulation steps (micro-batches per step when pp == 1)")
    g.add_argument("--micro-batches", dest="micro_batches", type=_positive, default=None,
                   help="pipeline micro-batches per step (pp > 1; default: --grad-accum)")
    g.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="pipeline schedule (default: VPP when --vpp > 1, else 1F1B)")
    g.add_argument("--vpp", type=_positive, default=None,
                   help="virtual pipeline stages per rank (schedule VPP; default 2 with --schedule VPP, else 1)")
    g.add_argument("--auto", action="store_true", help="auto_mode 'full': the planner picks the strategy")
    return parser


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v
