"""Cross-field rules of a Strategy (world size, model facts, batches): ``Strategy.validate`` and the
resolved degrees it returns."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Dict, List, Optional

from autoparallel.config import paddle_compat
from autoparallel.config.sections import _STEADY_SCHEDULES, MODEL_INFO_KEYS, AmpConfig


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
# of those, the ones a user may fix next to auto_mode "full": the search keeps them as constraints
# (planner/user_fixed.py); gradient_accumulation_steps is the loop's shape
_PLANNER_KEPT = ("data_parallel.degree", "tensor_parallel.degree", "pipeline_parallel.degree",
                 "sequence_parallel.enable", "sharding.enable", "sharding.stage", "recompute.enable",
                 "recompute.granularity", "gradient_accumulation_steps")


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


class ValidationMixin:
    """``validate`` of ``Strategy`` and the rules it checks."""

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
        problems += paddle_compat.problems(self)
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
        """auto_mode='full' chooses these itself: a value given for them would be ignored (the kept ones narrow
        the search instead)."""
        fresh = type(self)()
        for name in (n for n in _PLANNER_FIELDS if n not in _PLANNER_KEPT):
            section, _, leaf = name.partition(".")
            mine, default = getattr(self, section), getattr(fresh, section)
            if leaf:
                mine, default = getattr(mine, leaf), getattr(default, leaf)
            if mine != default:
                problems.append(f"auto_mode='full' chooses {name} itself, got {name}={mine!r}; expected "
                                f"auto_mode='semi' to fix it, or the default {default!r} (fixed degrees, "
                                f"sequence_parallel, sharding.stage and recompute are kept as search constraints)")

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
