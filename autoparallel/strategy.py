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

import argparse
import difflib
import json
import numbers
import os
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Dict, List, Optional

__all__ = [
    "Strategy", "ResolvedDegrees", "add_strategy_args",
    "DataParallelConfig", "TensorParallelConfig", "PipelineParallelConfig", "SequenceParallelConfig",
    "ShardingConfig", "RecomputeConfig", "AmpConfig", "CheckpointConfig",
    "SCHEDULES", "AUTO_MODES", "MODEL_INFO_KEYS",
]

SCHEDULES = ("FThenB", "1F1B", "VPP", "ZB-H1")       # pipeline schedules
AUTO_MODES = ("semi", "full")
MODEL_INFO_KEYS = ("heads", "kv_heads", "hidden", "layers", "vocab")   # keys validate() understands
_STEADY_SCHEDULES = ("1F1B", "VPP", "ZB-H1")          # need at least pp micro-batches to fill the pipeline


# ---------------------------------------------------------------------------------------------
# per-field checks: (qualified name, value) -> normalised value, or TypeError / ValueError

def _join_or(items) -> str:
    items = [repr(i) if isinstance(i, str) else str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _bool(name, v):
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be True or False, got {v!r}")
    return v


def _int(lo=1, optional=False):
    def check(name, v):
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            expected = f"an integer >= {lo}" + (" or None" if optional else "")
            raise TypeError(f"{name} must be {expected}, got {v!r}")
        if v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v}")
        return int(v)
    return check


def _float(lo=0.0, hi=None, lo_open=True, hi_open=True):
    def check(name, v):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} must be a number, got {v!r}")
        v = float(v)
        bad_lo = v <= lo if lo_open else v < lo
        bad_hi = hi is not None and (v >= hi if hi_open else v > hi)
        if bad_lo or bad_hi:
            rng = f"{'>' if lo_open else '>='} {lo:g}" + (f" and {'<' if hi_open else '<='} {hi:g}" if hi is not None else "")
            raise ValueError(f"{name} must be {rng}, got {v:g}")
        return v
    return check


def _choice(*choices):
    def check(name, v):
        if v not in choices or isinstance(v, bool):
            raise ValueError(f"{name} must be {_join_or(choices)}, got {v!r}")
        return v
    return check


def _path(name, v):
    if isinstance(v, os.PathLike):
        v = os.fspath(v)
    if not isinstance(v, str) or not v:
        raise TypeError(f"{name} must be a non-empty path string, got {v!r}")
    return v


def _names(name, v):
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
        raise TypeError(f"{name} must be a list of layer names (non-empty strings), got {v!r}")
    return list(v)


def _field(default, check, factory=None):
    if factory is not None:
        return field(default_factory=factory, metadata={"check": check})
    return field(default=default, metadata={"check": check})


def _unknown_message(section: str, names, valid) -> str:
    hints = []
    for n in names:
        close = difflib.get_close_matches(n, valid, n=1)
        if close:
            hints.append(f"{n!r} -> did you mean {close[0]!r}?")
    hint = f" ({'; '.join(hints)})" if hints else ""
    return f"{section} has no field {', '.join(repr(n) for n in names)}{hint}; valid fields: {', '.join(valid)}"


# ---------------------------------------------------------------------------------------------
# sub-configs

class _Config:
    """Base of every config dataclass: checked assignment, dict round-trip, compact repr."""

    _section: ClassVar[str] = ""

    @classmethod
    def field_names(cls) -> List[str]:
        return [f.name for f in fields(cls)]

    def __setattr__(self, name, value):
        spec = type(self).__dataclass_fields__.get(name)
        if spec is None:
            raise AttributeError(_unknown_message(self._section, [name], self.field_names()))
        check = spec.metadata.get("check")
        if check is not None:
            prefix = "" if self._section == "Strategy" else self._section + "."   # top-level fields are named bare
            value = check(prefix + name, value)
        object.__setattr__(self, name, value)

    def __getattr__(self, name):       # only reached when normal lookup fails
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(_unknown_message(self._section, [name], self.field_names()))

    def to_dict(self) -> Dict[str, Any]:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if isinstance(v, _Config) else list(v) if isinstance(v, list) else v
        return out

    @classmethod
    def from_dict(cls, d: Dict[str, Any]):
        if not isinstance(d, dict):
            raise TypeError(f"{cls._section} must be given as a dict, got {type(d).__name__}")
        unknown = [k for k in d if k not in cls.__dataclass_fields__]
        if unknown:
            raise ValueError("unknown keys: " + _unknown_message(cls._section, unknown, cls.field_names()))
        return cls(**d)

    def _non_default(self) -> Dict[str, Any]:
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._non_default().items())})"


@dataclass(repr=False)
class DataParallelConfig(_Config):
    _section: ClassVar[str] = "data_parallel"
    degree: Optional[int] = _field(None, _int(optional=True))      # ranks replicating the model; None: world // (tp x pp)


@dataclass(repr=False)
class TensorParallelConfig(_Config):
    _section: ClassVar[str] = "tensor_parallel"
    degree: int = _field(1, _int())                                # ranks splitting each layer's weights (Megatron TP)


@dataclass(repr=False)
class PipelineParallelConfig(_Config):
    _section: ClassVar[str] = "pipeline_parallel"
    degree: int = _field(1, _int())                                # pipeline stages (ranks along the layer axis)
    micro_batches: Optional[int] = _field(None, _int(optional=True))   # micro-batches per step when degree > 1; None: gradient_accumulation_steps, else degree
    schedule: str = _field("1F1B", _choice(*SCHEDULES))            # "FThenB", "1F1B", "VPP" (interleaved) or "ZB-H1" (zero bubble)
    vpp_degree: int = _field(1, _int())                            # virtual stages per rank; > 1 only with schedule "VPP"
    split_points: List[str] = _field(None, _names, factory=list)   # layer names starting stages 2..n (pp x vpp - 1 of them); []: balanced split


@dataclass(repr=False)
class SequenceParallelConfig(_Config):
    _section: ClassVar[str] = "sequence_parallel"
    enable: bool = _field(False, _bool)                            # shard norm/dropout activations on the sequence dim inside the TP group


@dataclass(repr=False)
class ShardingConfig(_Config):
    _section: ClassVar[str] = "sharding"
    enable: bool = _field(False, _bool)                            # ZeRO over the data-parallel axis
    stage: int = _field(1, _choice(1, 2, 3))                       # 1: optimizer states, 2: + gradients, 3: + parameters
    degree: Optional[int] = _field(None, _int(optional=True))      # None: all of dp; a divisor of dp: shard within groups, replicate across (HSDP)
    offload: bool = _field(False, _bool)                           # keep optimizer states and master weights in host memory; needs enable


@dataclass(repr=False)
class RecomputeConfig(_Config):
    _section: ClassVar[str] = "recompute"
    enable: bool = _field(False, _bool)                            # recompute activations in backward instead of saving them
    checkpoint_every_n_layers: int = _field(1, _int())             # one recompute segment per n transformer blocks
    granularity: str = _field("full", _choice("full", "selective"))   # "full": whole block; "selective": attention core only


@dataclass(repr=False)
class AmpConfig(_Config):
    _section: ClassVar[str] = "amp"
    enable: bool = _field(False, _bool)                            # mixed precision with fp32 master weights
    dtype: str = _field("bfloat16", _choice("bfloat16", "float16"))   # low-precision compute dtype
    level: str = _field("O1", _choice("O1", "O2"))                 # O1: per-op allow/deny lists; O2: cast the whole model
    init_loss_scaling: float = _field(65536.0, _float())           # initial loss scale; loss scaling applies to float16 only
    incr_every_n_steps: int = _field(2000, _int())                 # grow the scale after this many finite steps in a row
    decr_every_n_nan_or_inf: int = _field(1, _int())               # shrink the scale after this many overflowing steps
    incr_ratio: float = _field(2.0, _float(lo=1.0))                # scale growth factor, > 1
    decr_ratio: float = _field(0.5, _float(lo=0.0, hi=1.0))        # scale shrink factor, in (0, 1)
    use_dynamic_loss_scaling: bool = _field(True, _bool)           # False: keep init_loss_scaling fixed


@dataclass(repr=False)
class CheckpointConfig(_Config):
    _section: ClassVar[str] = "checkpoint"
    enable: bool = _field(False, _bool)                            # save distributed checkpoints during training
    save_interval_steps: int = _field(100, _int())                 # save every n optimizer steps
    dir: str = _field("checkpoints", _path)                        # directory holding one sub-directory per saved step
    keep_last: Optional[int] = _field(None, _int(optional=True))   # complete checkpoints to keep; None: keep all


_SECTIONS = {
    "data_parallel": DataParallelConfig, "tensor_parallel": TensorParallelConfig,
    "pipeline_parallel": PipelineParallelConfig, "sequence_parallel": SequenceParallelConfig,
    "sharding": ShardingConfig, "recompute": RecomputeConfig, "amp": AmpConfig, "checkpoint": CheckpointConfig,
}


def _sub(name):
    cls = _SECTIONS[name]

    def check(qualified, v):
        if isinstance(v, dict):
            return cls.from_dict(v)
        if type(v) is not cls:
            raise TypeError(f"{qualified} must be a {cls.__name__} (or a dict of its fields), got {type(v).__name__}")
        return v
    return _field(None, check, factory=cls)


# fields that act only when their section's switch is on: (section, switch, fields)
_DEPENDENTS = (
    ("sharding", "enable", ("stage",)),                   # degree and offload: _check_sharding
    ("recompute", "enable", ("checkpoint_every_n_layers", "granularity")),
    ("amp", "enable", ("dtype", "level", "init_loss_scaling", "incr_every_n_steps", "decr_every_n_nan_or_inf",
                       "incr_ratio", "decr_ratio", "use_dynamic_loss_scaling")),
    ("checkpoint", "enable", ("save_interval_steps", "dir", "keep_last")),
)
_LOSS_SCALING = ("init_loss_scaling", "incr_every_n_steps", "decr_every_n_nan_or_inf", "incr_ratio", "decr_ratio",
                 "use_dynamic_loss_scaling")
# chosen by the planner in auto_mode "full" (planner/auto.py keeps AMP, checkpoint, global batch and seed)
_PLANNER_FIELDS = ("data_parallel.degree", "tensor_parallel.degree", "pipeline_parallel.degree",
                   "pipeline_parallel.micro_batches", "pipeline_parallel.schedule", "pipeline_parallel.vpp_degree",
                   "pipeline_parallel.split_points", "sequence_parallel.enable", "sharding.enable", "sharding.stage",
                   "sharding.degree", "sharding.offload", "recompute.enable", "recompute.checkpoint_every_n_layers",
                   "recompute.granularity", "gradient_accumulation_steps", "micro_batch_size")


# ---------------------------------------------------------------------------------------------
# resolved degrees

@dataclass(frozen=True)
class ResolvedDegrees:
    """What the runtime builds from: every degree an int, dp inferred, batch sizes completed."""
    dp: int                               # data-parallel degree
    tp: int                               # tensor-parallel degree
    pp: int                               # pipeline stages
    vpp: int                              # virtual stages per pipeline rank (1 unless schedule "VPP")
    sharding_degree: int                  # ranks one ZeRO shard group spans (1 when sharding is off)
    sharding_stage: int                   # ZeRO stage 1-3, 0 when sharding is off
    num_micro_batches: int                # pipeline micro-batches (pp > 1) or accumulation steps (pp == 1)
    micro_batch_size: Optional[int] = None     # per data-parallel rank and micro-batch, when known
    global_batch_size: Optional[int] = None    # dp x micro_batch_size x num_micro_batches, when known

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


# ---------------------------------------------------------------------------------------------
# Strategy

@dataclass(repr=False)
class Strategy(_Config):
    """Composes DP / TP / SP / PP / ZeRO / recompute / AMP / checkpointing for one training run."""

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
    seed: Optional[int] = _field(None, _int(lo=0, optional=True))  # global random seed; None: leave RNGs alone

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

    # -- validation --------------------------------------------------------------------------

    def validate(self, world_size: Optional[int] = None,
                 model_info: Optional[Dict[str, Optional[int]]] = None) -> Optional[ResolvedDegrees]:
        """Check cross-field rules; return the resolved degrees (``None`` in auto_mode "full").

        ``world_size``: number of ranks, when known; dp x tp x pp must equal it (an unset dp is inferred).
        ``model_info``: any of ``MODEL_INFO_KEYS`` ("heads", "kv_heads", "hidden", "layers", "vocab"),
        values positive ints or None for unknown. TP must divide heads, kv_heads and hidden; the vocab need
        not be divisible (uneven shards are legal); pp x vpp must not exceed layers.
        Raises ValueError listing every broken rule with the expected and the given values.
        """
        if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral)
                                       or world_size < 1):
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        info = _check_model_info(model_info)
        problems: List[str] = []
        self._check_dependents(problems)
        if self.auto_mode == "full":        # degrees, schedule, sharding, recompute: chosen by the planner
            self._check_planner_fields(problems)
            _raise(problems)
            return None

        tp, pp = self.tensor_parallel.degree, self.pipeline_parallel.degree
        dp = self._resolve_dp(world_size, tp, pp, problems)
        self._check_model(info, tp, pp, problems)
        self._check_pipeline(pp, problems)
        if self.sequence_parallel.enable and tp == 1:
            problems.append("sequence_parallel.enable=True needs tensor_parallel.degree > 1 (sequence parallel "
                            "runs inside the tensor-parallel group), got tensor_parallel.degree=1")
        sharding_degree = self._check_sharding(dp, problems)
        nmb = self.num_micro_batches
        mbs, gbs = self._resolve_batches(dp, nmb, problems)
        _raise(problems)
        sh = self.sharding
        return ResolvedDegrees(dp=dp, tp=tp, pp=pp, vpp=self.pipeline_parallel.vpp_degree,
                               sharding_degree=sharding_degree, sharding_stage=sh.stage if sh.enable else 0,
                               num_micro_batches=nmb, micro_batch_size=mbs, global_batch_size=gbs)

    def _check_dependents(self, problems) -> None:
        """A field that acts only when its section is on is refused while it is off (nothing is ignored)."""
        for section, switch, names in _DEPENDENTS:
            cfg = getattr(self, section)
            if getattr(cfg, switch):
                continue
            default = type(cfg)()
            for n in names:
                if getattr(cfg, n) != getattr(default, n):
                    problems.append(f"{section}.{n}={getattr(cfg, n)!r} is set but {section}.{switch}=False; "
                                    f"expected {section}.{switch}=True or the default {getattr(default, n)!r}")
        c = self.pipeline_parallel
        if c.degree == 1 and c.schedule != "1F1B":
            problems.append(f"pipeline_parallel.schedule={c.schedule!r} needs pipeline_parallel.degree > 1, got 1")
        if self.amp.enable and self.amp.dtype == "bfloat16":
            default = AmpConfig()
            set_ = [n for n in _LOSS_SCALING if getattr(self.amp, n) != getattr(default, n)]
            if set_:
                problems.append(f"amp.{', amp.'.join(set_)} configure loss scaling, which applies to float16 only; "
                                f"amp.dtype='bfloat16' runs unscaled (expected amp.dtype='float16' or the defaults)")

    def _check_planner_fields(self, problems) -> None:
        """auto_mode='full' chooses these itself: a value given for them would be ignored."""
        fresh = Strategy()
        for name in _PLANNER_FIELDS:
            section, _, leaf = name.partition(".")
            mine, default = getattr(self, section), getattr(fresh, section)
            if leaf:
                mine, default = getattr(mine, leaf), getattr(default, leaf)
            if mine != default:
                problems.append(f"auto_mode='full' chooses {name} itself, got {name}={mine!r}; expected "
                                f"auto_mode='semi' to fix it, or the default {default!r}")

    def _resolve_dp(self, world_size, tp, pp, problems) -> Optional[int]:
        dp = self.data_parallel.degree
        if world_size is None:
            return 1 if dp is None else dp
        if dp is None:
            if world_size % (tp * pp):
                problems.append(f"cannot infer data_parallel.degree: world_size {world_size} is not divisible by "
                                f"tensor_parallel.degree x pipeline_parallel.degree = {tp} x {pp} = {tp * pp}")
                return None
            return world_size // (tp * pp)
        if dp * tp * pp != world_size:
            problems.append(f"data_parallel.degree x tensor_parallel.degree x pipeline_parallel.degree = {dp} x {tp} "
                            f"x {pp} = {dp * tp * pp}, expected the world size {world_size}")
        return dp

    def _check_model(self, info, tp, pp, problems):
        for key in ("heads", "kv_heads", "hidden"):
            n = info.get(key)
            if n is not None and n % tp:
                problems.append(f"tensor_parallel.degree={tp} must divide the model's {key}={n}")
        layers = info.get("layers")
        stages = pp * self.pipeline_parallel.vpp_degree
        if layers is not None and stages > layers:
            what = f"pipeline_parallel.degree={pp}" + (f" x vpp_degree={self.pipeline_parallel.vpp_degree} = {stages}"
                                                         if stages != pp else "")
            problems.append(f"{what} stages exceed the model's layers={layers}; expected at most {layers} stages")

    def _check_pipeline(self, pp, problems):
        c = self.pipeline_parallel
        if c.schedule == "VPP" and c.vpp_degree == 1:
            problems.append("pipeline_parallel.schedule='VPP' needs pipeline_parallel.vpp_degree > 1, got 1")
        if c.vpp_degree > 1 and c.schedule != "VPP":
            problems.append(f"pipeline_parallel.vpp_degree={c.vpp_degree} needs schedule 'VPP', got {c.schedule!r}")
        ga = self.gradient_accumulation_steps
        if pp == 1:
            if c.vpp_degree > 1:
                problems.append(f"pipeline_parallel.vpp_degree={c.vpp_degree} needs pipeline_parallel.degree > 1, got 1")
            if c.split_points:
                problems.append(f"pipeline_parallel.split_points={c.split_points} need pipeline_parallel.degree > 1, got 1")
            if c.micro_batches is not None and c.micro_batches != ga:
                problems.append(f"pipeline_parallel.micro_batches={c.micro_batches} only applies when "
                                f"pipeline_parallel.degree > 1 (got 1); without a pipeline, micro-batches are "
                                f"gradient_accumulation_steps (got {ga})")
            return
        if c.micro_batches is not None and ga != 1 and ga != c.micro_batches:
            problems.append(f"with pipeline_parallel.degree={pp}, pipeline_parallel.micro_batches={c.micro_batches} and "
                            f"gradient_accumulation_steps={ga} both set the micro-batches per step; expected equal "
                            f"values or only one of them")
        m = self.num_micro_batches
        if c.schedule in _STEADY_SCHEDULES and m < pp:
            problems.append(f"schedule {c.schedule!r} needs at least pipeline_parallel.degree={pp} micro-batches per "
                            f"step, got {m}")
        if c.schedule == "VPP" and m % pp:
            problems.append(f"schedule 'VPP' needs the micro-batches per step ({m}) to be a multiple of "
                            f"pipeline_parallel.degree={pp}")
        if c.split_points:
            want = pp * c.vpp_degree - 1
            if len(c.split_points) != want:
                problems.append(f"pipeline_parallel.split_points has {len(c.split_points)} names, expected "
                                f"pp x vpp - 1 = {want} (one per stage boundary)")
            dup = sorted({n for n in c.split_points if c.split_points.count(n) > 1})
            if dup:
                problems.append(f"pipeline_parallel.split_points repeats {dup}; each boundary must be distinct")

    def _check_sharding(self, dp, problems) -> int:
        sh = self.sharding
        if not sh.enable:
            if sh.offload:
                problems.append("sharding.offload=True needs sharding.enable=True (offload moves the sharded "
                                "optimizer states to host memory), got sharding.enable=False")
            if sh.degree is not None:
                problems.append(f"sharding.degree={sh.degree} is set but sharding.enable=False; expected "
                                f"sharding.enable=True or sharding.degree=None")
            return 1
        if dp is None:                       # already reported: dp could not be inferred
            return sh.degree or 1
        degree = dp if sh.degree is None else sh.degree
        if dp % degree:
            problems.append(f"sharding.degree={degree} must divide the data-parallel degree {dp} (shard within groups "
                            f"of sharding.degree ranks, replicate across them)")
        return degree

    def _resolve_batches(self, dp, nmb, problems):
        mbs, gbs = self.micro_batch_size, self.global_batch_size
        if dp is None:
            return mbs, gbs
        if mbs is not None and gbs is not None:
            if gbs != dp * mbs * nmb:
                problems.append(f"global_batch_size={gbs}, expected dp x micro_batch_size x num_micro_batches = "
                                f"{dp} x {mbs} x {nmb} = {dp * mbs * nmb}")
        elif gbs is not None:
            if gbs % (dp * nmb):
                problems.append(f"global_batch_size={gbs} must be divisible by dp x num_micro_batches = "
                                f"{dp} x {nmb} = {dp * nmb}")
            else:
                mbs = gbs // (dp * nmb)
        elif mbs is not None:
            gbs = dp * mbs * nmb
        return mbs, gbs

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
        return Strategy.from_dict(self.to_dict())

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
            line += f" ({sched}, {self.num_micro_batches} micro-batches)"
            if c.split_points:
                line += f" split at {', '.join(c.split_points)}"
        elif self.gradient_accumulation_steps > 1:
            line += f" ({self.gradient_accumulation_steps} accumulation steps)"
        return line

    # -- command line ------------------------------------------------------------------------

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Strategy":
        """Build from flags added by ``add_strategy_args`` (missing or None attributes keep defaults).

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
        s.pipeline_parallel.schedule = schedule or ("VPP" if vpp > 1 else "1F1B")
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


def _check_model_info(model_info) -> Dict[str, int]:
    if model_info is None:
        return {}
    if not isinstance(model_info, dict):
        raise TypeError(f"model_info must be a dict with keys among {list(MODEL_INFO_KEYS)}, "
                        f"got {type(model_info).__name__}")
    unknown = sorted(k for k in model_info if k not in MODEL_INFO_KEYS)
    if unknown:
        raise ValueError(f"model_info has unknown keys {unknown}; valid keys: {list(MODEL_INFO_KEYS)}")
    out = {}
    for k, v in model_info.items():
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"model_info[{k!r}] must be a positive integer or None, got {v!r}")
        out[k] = int(v)
    return out


def _raise(problems: List[str]) -> None:
    if len(problems) == 1:
        raise ValueError(f"invalid Strategy: {problems[0]}")
    if problems:
        raise ValueError(f"invalid Strategy ({len(problems)} problems):\n" + "\n".join(f"  - {p}" for p in problems))
