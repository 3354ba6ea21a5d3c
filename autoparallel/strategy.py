"""Strategy: one object that composes every parallelism of a training run.

    s = Strategy()
    s.data_parallel.degree = 2; s.tensor_parallel.degree = 4
    s.pipeline_parallel.degree = 2; s.pipeline_parallel.schedule = "1F1B"
    s.sharding.enable = True; s.sharding.stage = 3
    s.amp.enable = True; s.amp.dtype = "bfloat16"
    r = s.validate(world_size=16, model_info={"heads": 32, "hidden": 4096, "layers": 32})

Every sub-config is a small dataclass. Assigning a field checks its type and range at once
(``s.sharding.stage = 4`` raises ValueError); assigning an unknown name (``s.sharding.stagee = 2``)
raises AttributeError listing the valid fields. Rules that involve several fields, the world size or
the model live in ``Strategy.validate``, which runs before any process work and returns the resolved
degrees (``ResolvedDegrees``) the runtime builds its mesh from.

Degrees and batches (DESIGN, "Degrees and batches"):
  * world = dp x tp x pp. ``data_parallel.degree`` may stay ``None``: ``validate`` infers it as
    world_size // (tp x pp), or 1 when no world size is given. tp and pp are always explicit (default 1).
  * Sequence parallel lives inside the tensor-parallel group, so it needs tp > 1.
  * Sharding (ZeRO) runs over the data-parallel axis. ``sharding.degree = None`` shards over all of dp;
    a smaller degree dividing dp shards within groups of that size and replicates across them (HSDP).
  * global_batch = dp x micro_batch_size x num_micro_batches, where num_micro_batches is
    ``pipeline_parallel.micro_batches`` when pp > 1 and ``gradient_accumulation_steps`` otherwise.
    ``gradient_accumulation_steps = 1`` (the default) counts as unset: with pp > 1, setting both to
    different values is an error, and an unset ``micro_batches`` falls back to the accumulation steps, or to
    ``pipeline_parallel.degree`` micro-batches when those are unset too.

auto_mode (DESIGN, "auto_mode"): "semi" keeps the user's degrees and annotations. "full" lets the
planner choose degrees, schedule, sharding, recompute, offload and micro-batching, so those fields are
ignored and ``validate`` returns ``None`` (the planner returns a concrete "semi" Strategy to validate).
AMP, checkpointing, batch sizes and the seed are honoured in both modes.

This module is pure Python: it does not import paddle.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional

from autoparallel.config import paddle_compat
from autoparallel.config.cli import CliMixin, add_strategy_args
from autoparallel.config.fields import _choice, _field, _int
from autoparallel.config.sections import (AUTO_MODES, MODEL_INFO_KEYS, SCHEDULES, AmpConfig,  # noqa: F401
                                          CheckpointConfig, DataParallelConfig, PipelineParallelConfig,
                                          RecomputeConfig, SequenceParallelConfig, ShardingConfig,
                                          TensorParallelConfig, _Config, _sub)
from autoparallel.config.validation import ResolvedDegrees, ValidationMixin

__all__ = [
    "Strategy", "ResolvedDegrees", "add_strategy_args",
    "DataParallelConfig", "TensorParallelConfig", "PipelineParallelConfig", "SequenceParallelConfig",
    "ShardingConfig", "RecomputeConfig", "AmpConfig", "CheckpointConfig",
    "SCHEDULES", "AUTO_MODES", "MODEL_INFO_KEYS",
]


@dataclass(repr=False, init=False)
class Strategy(_Config, ValidationMixin, CliMixin):
    """Composes DP / TP / SP / PP / ZeRO / recompute / AMP / checkpointing for one training run.

    ``Strategy(config)`` takes paddle's ``dist.Strategy`` config dict; ``Strategy(**fields)`` our fields.
    paddle's section names (``pipeline``, ``gradient_merge``, ``fused_passes``) and paddle-only fields are
    mapped or refused (config/paddle_compat.py)."""

    _section: ClassVar[str] = "Strategy"
    auto_mode: str = _field("semi", _choice(*AUTO_MODES))          # "semi": user degrees and annotations; "full": the planner decides
    data_parallel: DataParallelConfig = _sub("data_parallel")          # replicate the model, split the batch
    tensor_parallel: TensorParallelConfig = _sub("tensor_parallel")    # split layers' weights
    pipeline_parallel: PipelineParallelConfig = _sub("pipeline_parallel")   # split the layer stack into stages
    sequence_parallel: SequenceParallelConfig = _sub("sequence_parallel")   # sequence-sharded activations inside TP
    sharding: ShardingConfig = _sub("sharding")                        # ZeRO stage 1-3 over the data axis, offload
    recompute: RecomputeConfig = _sub("recompute")                     # activation recomputation
    amp: AmpConfig = _sub("amp")                                       # mixed precision and loss scaling
    checkpoint: CheckpointConfig = _sub("checkpoint")                  # periodic distributed checkpoints
    gradient_accumulation_steps: int = _field(1, _int())           # micro-steps per optimizer step when pp == 1
    micro_batch_size: Optional[int] = _field(None, _int(optional=True))    # samples per dp rank per micro-batch; None: from global
    global_batch_size: Optional[int] = _field(None, _int(optional=True))   # samples per optimizer step over all ranks
    # global random seed, in numpy's range (paddle, numpy and random are seeded with it); None: leave RNGs alone
    seed: Optional[int] = _field(None, _int(lo=0, optional=True, hi=2 ** 32 - 1, hi_text="2**32 - 1"))

    def __init__(self, config: Optional[Dict[str, Any]] = None, **fields):
        for f in dataclasses.fields(self):
            if f.name in fields:
                value = fields.pop(f.name)
            else:
                value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(self, f.name, value)
        if fields:
            raise TypeError(f"Strategy() got unknown fields {sorted(fields)}; valid fields: "
                            f"{', '.join(self.field_names())}")
        if config is not None:
            paddle_compat.apply_config(self, config)

    # -- paddle.distributed.Strategy's sections (views onto the fields above) --------------------------
    @property
    def pipeline(self) -> paddle_compat.PipelineView:
        return paddle_compat.PipelineView(self)

    @property
    def gradient_merge(self) -> paddle_compat.GradientMergeView:
        return paddle_compat.GradientMergeView(self)

    @property
    def fused_passes(self) -> paddle_compat.FusedPassesView:
        return paddle_compat.FusedPassesView(self)

    # -- derived values ----------------------------------------------------------------------

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per optimizer step: pipeline micro_batches when pp > 1, else accumulation steps."""
        pp = self.pipeline_parallel
        if pp.degree > 1 and pp.micro_batches is not None:
            return pp.micro_batches
        if pp.degree > 1 and self.gradient_accumulation_steps == 1:
            return pp.degree                    # the article's pipeline config: one micro-batch per stage
        return self.gradient_accumulation_steps

    # -- serialisation -----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Strategy":
        """Build from ``to_dict()`` output; missing keys keep their defaults, unknown keys raise ValueError."""
        return super().from_dict(d)

    def to_json(self, path: Optional[str] = None, indent: int = 2) -> str:
        """JSON text of ``to_dict()``; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path) -> "Strategy":
        """Parse JSON text (a string starting with '{') or read a JSON file (any other string or path)."""
        if isinstance(text_or_path, str) and text_or_path.lstrip().startswith("{"):
            text, where = text_or_path, "JSON text"
        else:
            if not isinstance(text_or_path, (str, os.PathLike)):
                raise TypeError(f"Strategy.from_json expects JSON text (a str starting with '{{') or a file path, "
                                f"got {type(text_or_path).__name__} {text_or_path!r:.60}")
            path = os.fspath(text_or_path)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"strategy JSON file {path!r} does not exist (pass JSON text starting "
                                        f"with '{{' or the path of a file)")
            with open(path) as f:
                text, where = f.read(), path
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid strategy JSON in {where}: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"strategy JSON in {where} must be an object, got {type(d).__name__}")
        return cls.from_dict(d)

    def copy(self) -> "Strategy":
        out = Strategy.from_dict(self.to_dict())
        if "_paddle_state" in self.__dict__:           # paddle-name flags (pipeline.enable, gradient_merge.*)
            out.__dict__["_paddle_state"] = dict(self.__dict__["_paddle_state"])
        return out

    # -- printing ----------------------------------------------------------------------------

    def __repr__(self):
        parts = [f"{k}={v!r}" for k, v in self._non_default().items()]
        return f"Strategy({', '.join(parts)})"

    def __str__(self):
        head = f"auto_mode={self.auto_mode}" + (f", seed={self.seed}" if self.seed is not None else "")
        lines = [f"Strategy({head})"]
        if self.auto_mode == "full":
            lines.append("  degrees, schedule, sharding, recompute, micro-batching: chosen by the planner")
        else:
            lines.append("  " + self._degrees_line())
            sh = self.sharding
            if sh.enable:
                over = "over dp" if sh.degree is None else f"over groups of {sh.degree} within dp (HSDP)"
                lines.append(f"  sharding: stage {sh.stage} {over}" + (", offload" if sh.offload else ""))
            elif sh.offload:
                lines.append("  offload without sharding (invalid)")
            rc = self.recompute
            if rc.enable:
                n = rc.checkpoint_every_n_layers
                lines.append(f"  recompute: {rc.granularity} every {'layer' if n == 1 else f'{n} layers'}")
        amp = self.amp
        if amp.enable:
            line = f"  amp: {amp.dtype} {amp.level}"
            if amp.dtype == "float16":
                kind = "dynamic" if amp.use_dynamic_loss_scaling else "static"
                line += f", {kind} loss scale {amp.init_loss_scaling:g}"
            lines.append(line)
        if self.micro_batch_size is not None or self.global_batch_size is not None:
            parts = [f"{k} {v}" for k, v in (("micro", self.micro_batch_size), ("global", self.global_batch_size))
                     if v is not None]
            lines.append(f"  batch: {', '.join(parts)}")
        ck = self.checkpoint
        if ck.enable:
            keep = f", keep last {ck.keep_last}" if ck.keep_last is not None else ""
            lines.append(f"  checkpoint: every {ck.save_interval_steps} steps to {ck.dir}{keep}")
        return "\n".join(lines)

    def _degrees_line(self) -> str:
        dp = self.data_parallel.degree
        tp = f"{self.tensor_parallel.degree}" + ("+sp" if self.sequence_parallel.enable else "")
        c = self.pipeline_parallel
        line = f"dp={'auto' if dp is None else dp} tp={tp} pp={c.degree}"
        if c.degree > 1:
            sched = f"VPP x{c.vpp_degree}" if c.schedule == "VPP" else c.schedule
            if not c.schedule_chosen():             # left at its default: called without labels it runs FThenB
                sched += "; FThenB for loss_fn(model(x), y)"
            line += f" ({sched}, {self.num_micro_batches} micro-batches)"
            if c.split_points:
                line += f" split at {', '.join(c.split_points)}"
        elif self.gradient_accumulation_steps > 1:
            line += f" ({self.gradient_accumulation_steps} accumulation steps)"
        return line
