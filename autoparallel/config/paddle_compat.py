"""paddle.distributed.Strategy's names on our Strategy: honoured (mapped onto our fields) or refused.

    s = ap.Strategy({"sharding": {"enable": True, "stage": 2}, "gradient_merge": {"enable": True, "k_steps": 4}})
    s.pipeline.enable = True; s.pipeline.pp_degree = 2; s.pipeline.schedule_mode = "1F1B"
    s.gradient_merge.enable = True; s.gradient_merge.k_steps = 4       # = s.gradient_accumulation_steps = 4
    s.amp.level = "o2"                                                  # = "O2"

Every field of paddle 3.3's ``dist.Strategy`` is classified here: ``MAPPED`` fields write our own fields (one
source of truth: the Strategy's dataclass fields, which ``entry_points.TABLE`` classifies per entry point);
``PADDLE_ONLY`` fields accept their paddle default (which is what we do) and refuse any other value with
NotImplementedError naming the field, the value and why. Reading a paddle-only field gives its default.
"""
from __future__ import annotations

import numbers

# paddle-only fields: {section: {field: paddle's default}}; a non-default value is refused
PADDLE_ONLY = {
    "Strategy": {"gradient_scale": True, "gradient_scale_using_allreduce_avg": False, "use_cache": True,
                 "return_numpy": True, "all_ranks": False, "split_data": True, "reinit": False,
                 "full_graph": True},
    "sharding": {"enable_overlap": False, "param_comm_stream_num": 1, "grad_comm_stream_num": 1,
                 "param_bucket_size_numel": 1, "grad_bucket_size_numel": 1, "enable_hierarchical_comm": False,
                 "partition_algor": "greedy_even", "enable_tuning": False, "tuning_range": [],
                 "release_gradients": False, "comm_buffer_size_MB": 256, "enable_tensor_fusion": False,
                 "save_unbalanced_param": True},
    "amp": {"custom_white_list": [], "custom_black_list": [], "custom_black_varnames": [], "use_fp16_guard": False,
            "use_bf16_guard": False, "use_master_grad": False, "use_promote": True},
    "pipeline": {"vpp_seg_method": "", "generation_batch_size": 1, "enable_send_recv_overlap": False,
                 "job_schedule_profiler_start": -1, "job_schedule_profiler_stop": -1,
                 "program_runtimes": [61, 72, 71, 34, 3], "memory_limit_times": -1, "split_backward": False,
                 "auto_parallel_sync_shared_params": False},
    "fused_passes": {"enable": False, "gemm_epilogue": False, "dropout_add": False},
    "mp_optimization": {"allreduce_matmul_grad_overlapping": False, "replace_with_c_embedding": False,
                        "replace_with_parallel_cross_entropy": False},
    "dp_optimization": {"enable": False, "fuse_all_reduce_ops": True, "fuse_grad_size_in_MB": 32,
                        "overlap_comm_cacl": True, "gradient_sync_after_accumulate": False},
    "sp_optimization": {"enable": True},
    "recompute": {"checkpoints": [], "no_recompute_segments": [], "sr": 0, "refined_ops_patterns": [],
                  "enable_tuning": False},
}
WHY = {
    "gradient_scale": "data-parallel gradients are always averaged over the data-parallel ranks",
    "full_graph": "ap.to_static captures the whole step as one graph",
    "fused_passes": "fused kernels (gemm epilogue, dropout+add) are static-graph passes of paddle's GPU build",
    "sharding": "the ZeRO runtime fixes its own communication (one fused bucket size, no extra streams)",
    "amp": "AMP here casts by paddle's default op lists with fp32 master weights",
    "pipeline": "the pipeline runtime schedules by strategy.pipeline_parallel",
    "recompute": "recompute is per layer block: strategy.recompute.enable / checkpoint_every_n_layers / "
                 "granularity",
}
# paddle's pipeline.schedule_mode -> ours
SCHEDULES = {"FThenB": "FThenB", "1F1B": "1F1B", "VPP": "VPP", "ZBH1": "ZB-H1", "ZB-H1": "ZB-H1"}
# paddle's amp defaults, used for the fields a paddle config dict's "amp" section leaves out
PADDLE_AMP_DEFAULTS = {"dtype": "float16", "init_loss_scaling": 32768.0, "incr_every_n_steps": 1000,
                       "decr_every_n_nan_or_inf": 2, "decr_ratio": 0.8}


def _same(a, b) -> bool:
    """``a`` (a value given) is paddle's default ``b``: the same list, flag or number (numpy scalars by value; a
    bool is not the number 1, a float not an int default)."""
    if isinstance(a, (list, tuple)):
        return list(a) == list(b)
    if isinstance(b, bool):
        return type(a).__name__ in ("bool", "bool_") and a == b
    if isinstance(b, numbers.Number):
        kind = numbers.Integral if isinstance(b, int) else numbers.Real
        return isinstance(a, kind) and type(a).__name__ not in ("bool", "bool_") and a == b
    return type(a) is type(b) and a == b


def refuse_or_accept(section: str, name: str, value) -> bool:
    """True when ``name`` is a paddle-only field of ``section`` set to paddle's default (nothing to do); raises
    NotImplementedError for another value; False when ``name`` is not a paddle field."""
    fields = PADDLE_ONLY.get(section, {})
    if name not in fields:
        return False
    if _same(value, fields[name]):
        return True
    prefix = "" if section == "Strategy" else section + "."
    why = WHY.get(name) or WHY.get(section) or "paddle's legacy static engine option, not part of this runtime"
    raise NotImplementedError(f"strategy.{prefix}{name}={value!r} is not supported ({why}); only paddle's default "
                              f"{fields[name]!r} is accepted")


def paddle_default(section: str, name: str):
    """paddle's default of a paddle-only field (what reading it returns); AttributeError if there is none."""
    fields = PADDLE_ONLY.get(section, {})
    if name not in fields:
        raise AttributeError(name)
    v = fields[name]
    return list(v) if isinstance(v, list) else v


class _View:
    """A paddle section that has no dataclass of its own here; attributes map onto the Strategy's fields."""

    _section = ""
    _mapped: tuple = ()

    def __init__(self, strategy):
        object.__setattr__(self, "_s", strategy)

    @property
    def _state(self) -> dict:
        return self._s.__dict__.setdefault("_paddle_state", {})

    def __getattr__(self, name):
        try:
            return paddle_default(self._section, name)
        except AttributeError:
            fields = list(self._mapped) + list(PADDLE_ONLY.get(self._section, {}))
            raise AttributeError(f"strategy.{self._section} has no field {name!r}; fields: "
                                 f"{', '.join(fields)}") from None

    def __setattr__(self, name, value):
        if name in self._mapped:
            return getattr(type(self), "_set_" + name)(self, value)
        if not refuse_or_accept(self._section, name, value):
            self.__getattr__(name)                   # AttributeError listing the fields

    def __repr__(self):
        return f"{self._section}({', '.join(f'{n}={getattr(self, n)!r}' for n in self._mapped)})"


class PipelineView(_View):
    """paddle's ``strategy.pipeline`` over ``strategy.pipeline_parallel`` and ``strategy.micro_batch_size``."""
    _section = "pipeline"
    _mapped = ("enable", "schedule_mode", "pp_degree", "vpp_degree", "micro_batch_size", "accumulate_steps")

    @property
    def enable(self):
        return bool(self._state.get("pipeline.enable")) or self._s.pipeline_parallel.degree > 1

    def _set_enable(self, v):
        from autoparallel.config.fields import _bool

        v = _bool("strategy.pipeline.enable", v)          # numpy's bool as a bool
        self._state["pipeline.enable"] = v
        if not v and self._s.pipeline_parallel.degree > 1:
            raise ValueError(f"strategy.pipeline.enable=False but strategy.pipeline_parallel.degree="
                             f"{self._s.pipeline_parallel.degree}; set pipeline.pp_degree = 1 to turn it off")

    @property
    def schedule_mode(self):
        return {v: k for k, v in SCHEDULES.items() if k != "ZB-H1"}[self._s.pipeline_parallel.schedule]

    def _set_schedule_mode(self, v):
        if v not in SCHEDULES:
            raise NotImplementedError(f"strategy.pipeline.schedule_mode={v!r} is not supported; expected one of "
                                      f"{[k for k in SCHEDULES if k != 'ZB-H1']}")
        self._s.pipeline_parallel.schedule = SCHEDULES[v]

    @property
    def pp_degree(self):
        return self._s.pipeline_parallel.degree

    def _set_pp_degree(self, v):
        self._s.pipeline_parallel.degree = v

    @property
    def vpp_degree(self):
        return self._s.pipeline_parallel.vpp_degree

    def _set_vpp_degree(self, v):
        self._s.pipeline_parallel.vpp_degree = v

    @property
    def micro_batch_size(self):
        v = self._s.micro_batch_size
        return 1 if v is None else v

    def _set_micro_batch_size(self, v):
        self._s.micro_batch_size = v

    @property
    def accumulate_steps(self):
        v = self._s.pipeline_parallel.micro_batches
        return 1 if v is None else v

    def _set_accumulate_steps(self, v):
        self._s.pipeline_parallel.micro_batches = v


class GradientMergeView(_View):
    """paddle's ``strategy.gradient_merge`` over ``strategy.gradient_accumulation_steps`` (averaged, as
    ``avg=True``)."""
    _section = "gradient_merge"
    _mapped = ("enable", "k_steps", "avg")

    @property
    def enable(self):
        return bool(self._state.get("gradient_merge.enable")) or self._s.gradient_accumulation_steps > 1

    def _set_enable(self, v):
        from autoparallel.config.fields import _bool

        v = _bool("strategy.gradient_merge.enable", v)    # numpy's bool as a bool
        k = self.k_steps                       # k_steps given, else the accumulation steps already set
        ga = self._s.gradient_accumulation_steps
        if not v and ga > 1 and not self._state.get("gradient_merge.enable"):
            raise ValueError(f"strategy.gradient_merge.enable=False but strategy.gradient_accumulation_steps={ga}; "
                             f"set gradient_accumulation_steps = 1 to turn accumulation off")
        self._state["gradient_merge.enable"] = v
        self._s.gradient_accumulation_steps = k if v else 1

    @property
    def k_steps(self):
        return self._state.get("gradient_merge.k_steps", max(1, self._s.gradient_accumulation_steps))

    def _set_k_steps(self, v):
        from autoparallel.config.fields import _int

        v = _int()("gradient_merge.k_steps", v)
        self._state["gradient_merge.k_steps"] = v
        if self._state.get("gradient_merge.enable"):
            self._s.gradient_accumulation_steps = v

    @property
    def avg(self):
        return True

    def _set_avg(self, v):
        if v is not True:
            raise NotImplementedError(f"strategy.gradient_merge.avg={v!r} is not supported: accumulated gradients "
                                      f"are averaged over the k_steps micro-steps (avg=True); to sum instead, "
                                      f"scale the loss by k_steps")


class FusedPassesView(_View):
    _section = "fused_passes"


def problems(strategy) -> list:
    """Cross-field rules of the paddle names (for Strategy.validate)."""
    state = strategy.__dict__.get("_paddle_state", {})
    out = []
    if state.get("pipeline.enable") and strategy.pipeline_parallel.degree == 1:
        out.append("pipeline.enable=True needs the number of stages: set strategy.pipeline.pp_degree (= "
                   "pipeline_parallel.degree) > 1")
    k = state.get("gradient_merge.k_steps", 1)
    if k != 1 and not state.get("gradient_merge.enable"):
        out.append(f"gradient_merge.k_steps={k} is set but gradient_merge.enable is not True; expected "
                   f"gradient_merge.enable=True (= gradient_accumulation_steps={k}) or the default k_steps 1")
    ga = strategy.gradient_accumulation_steps
    if state.get("gradient_merge.enable") and "gradient_merge.k_steps" in state and k != ga:
        out.append(f"gradient_merge.k_steps={k} and gradient_accumulation_steps={ga} both set the accumulation "
                   f"steps; expected equal values or only one of them")
    return out


def apply_config(strategy, config: dict) -> None:
    """paddle's ``dist.Strategy(config)``: a dict of sections ({"sharding": {...}, "pipeline": {...}, ...}) and
    base fields; our own field names are accepted too. The ``amp`` section takes paddle's defaults for the
    fields it leaves out (float16, loss scale 32768, ...)."""
    if not isinstance(config, dict):
        raise ValueError(f"Strategy(config) expects a dict, got {type(config).__name__} {config!r:.60}")
    for key, value in config.items():
        if isinstance(value, dict):
            section = getattr(strategy, key) if key in _SECTIONS or key in strategy.__dataclass_fields__ else None
            if section is None:
                if key not in PADDLE_ONLY:
                    ours = [f for f in strategy.__dataclass_fields__ if hasattr(getattr(strategy, f), "field_names")]
                    _unknown(key, "", sorted(set(ours) | set(_SECTIONS) | set(PADDLE_ONLY) - {"Strategy"}))
                for name, v in value.items():
                    refuse_or_accept(key, name, v) or _unknown(key, name)
                continue
            if key == "amp" and value.get("enable") is True:
                value = {**_amp_defaults(value), **value}
            elif key == "amp":
                value = _amp_off(strategy, value)
            elif key in PADDLE_OFF_DEFAULTS and _off(key, value):
                value = {k: v for k, v in value.items() if not (k in PADDLE_OFF_DEFAULTS[key]
                                                                and _paddle_default_value(v, PADDLE_OFF_DEFAULTS[key][k]))}
            for name, v in value.items():
                _set(section, name, v)
        else:
            _set(strategy, key, value)


def _set(obj, name, value) -> None:
    """A config dict's key: a misspelt one is a ValueError (as in ``Strategy.from_dict``), naming the valid ones."""
    try:
        setattr(obj, name, value)
    except AttributeError as e:
        raise ValueError(f"Strategy(config): {e}") from None


_SECTIONS = ("pipeline", "gradient_merge", "fused_passes")


def _amp_defaults(amp: dict) -> dict:
    """paddle's defaults for what an enabled ``amp`` section leaves out: float16, and its loss scaling."""
    if amp.get("dtype", "float16") != "float16":
        return {}
    return {k: v for k, v in PADDLE_AMP_DEFAULTS.items() if k not in amp}


# paddle's defaults of mapped fields whose value differs from ours; a section that is off restating them sets nothing
PADDLE_OFF_DEFAULTS = {
    "sharding": {"enable": False, "stage": 1, "degree": 8},
    "pipeline": {"enable": False, "schedule_mode": "1F1B", "pp_degree": 1, "vpp_degree": 1, "micro_batch_size": 1,
                 "accumulate_steps": 1},
    "gradient_merge": {"enable": False, "k_steps": 1, "avg": True},
}


def _off(key, section: dict) -> bool:
    """A paddle section in a config dict that does not switch its feature on (pipeline: nor gives stages)."""
    if section.get("enable") is True:
        return False
    return key != "pipeline" or section.get("pp_degree", 1) == 1


def _amp_off(strategy, amp: dict) -> dict:
    """An ``amp`` section that does not enable AMP: paddle's defaults restated are dropped (nothing to set), any
    other value would do nothing (paddle ignores it too) and is refused."""
    if strategy.amp.enable:
        return amp
    defaults = {**PADDLE_AMP_DEFAULTS, "enable": False, "level": "o1", "incr_ratio": 2.0,
                "use_dynamic_loss_scaling": True}
    out = {}
    for name, v in amp.items():
        if name in PADDLE_ONLY["amp"]:
            out[name] = v                              # accepted at paddle's default, refused otherwise
        elif name not in defaults:
            out[name] = v                              # not a field: refused by the section itself
        elif not _paddle_default_value(v, defaults[name]):
            raise ValueError(f"Strategy(config): amp.{name}={v!r} is set but amp.enable is not True, so it "
                             f"would do nothing; expected amp.enable=True or paddle's default "
                             f"{defaults[name]!r}")
    return out


def _paddle_default_value(v, default) -> bool:
    if isinstance(default, str):
        return isinstance(v, str) and v.lower() == default.lower()
    if isinstance(default, bool) or isinstance(v, bool):
        return v is default
    return isinstance(v, (int, float)) and v == default


def _unknown(section, name, sections=()):
    if section not in PADDLE_ONLY:
        raise ValueError(f"Strategy(config): unknown section {section!r}; sections: {', '.join(sections)}")
    raise ValueError(f"Strategy(config): {section} has no field {name!r}; fields: {', '.join(PADDLE_ONLY[section])}")

