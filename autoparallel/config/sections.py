"""The sub-config sections of a Strategy (data_parallel, sharding, amp, ...): small dataclasses whose fields
check themselves on assignment, with a dict round-trip."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Dict, List, Optional

from autoparallel.config.fields import _bool, _choice, _field, _float, _int, _names, _path, _unknown_message
from autoparallel.config.paddle_compat import paddle_default, refuse_or_accept

SCHEDULES = ("FThenB", "1F1B", "VPP", "ZB-H1")       # pipeline schedules
AUTO_MODES = ("semi", "full")
MODEL_INFO_KEYS = ("heads", "kv_heads", "hidden", "layers", "vocab")   # keys validate() understands
_STEADY_SCHEDULES = ("1F1B", "VPP", "ZB-H1")          # need at least pp micro-batches to fill the pipeline


class _Config:
    """Base of every config dataclass: checked assignment, dict round-trip, compact repr."""

    _section: ClassVar[str] = ""

    @classmethod
    def field_names(cls) -> List[str]:
        return [f.name for f in fields(cls)]

    def __setattr__(self, name, value):
        spec = type(self).__dataclass_fields__.get(name)
        if spec is None:
            if refuse_or_accept(self._section, name, value):     # paddle's field at its default: nothing to do
                return
            raise AttributeError(_unknown_message(self._section, [name], self.field_names()))
        check = spec.metadata.get("check")
        if check is not None:
            prefix = "" if self._section == "Strategy" else self._section + "."   # top-level fields are named bare
            value = check(prefix + name, value)
        object.__setattr__(self, name, value)

    def __getattr__(self, name):       # only reached when normal lookup fails
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return paddle_default(self._section, name)         # a paddle-only field reads as paddle's default
        except AttributeError:
            pass
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

    def __post_init__(self):
        object.__setattr__(self, "_assigned", set())     # fields assigned after construction

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if "_assigned" in self.__dict__:
            self._assigned.add(name)

    def schedule_chosen(self) -> bool:
        """Whether the schedule was chosen rather than left at its default: assigned after construction (also to
        "1F1B"), or built with another value. A pipeline called as ``loss_fn(model(x), y)`` runs FThenB when the
        schedule was left at its default (parallel/pipeline/external_loss.py)."""
        return "schedule" in self.__dict__.get("_assigned", ()) or self.schedule != "1F1B"


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


def _amp_level(name, v):
    """"O1" / "O2" (paddle's dist.Strategy spells them "o1" / "o2")."""
    return _choice("O1", "O2")(name, v.upper() if isinstance(v, str) and v.lower() in ("o1", "o2") else v)


@dataclass(repr=False)
class AmpConfig(_Config):
    _section: ClassVar[str] = "amp"
    enable: bool = _field(False, _bool)                            # mixed precision with fp32 master weights
    dtype: str = _field("bfloat16", _choice("bfloat16", "float16"))   # low-precision compute dtype
    level: str = _field("O1", _amp_level)                          # O1: per-op allow/deny lists; O2: cast the whole model ("o1"/"o2" as paddle spells them)
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
