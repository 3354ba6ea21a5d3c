"""ParallelConfig: one point of the planner's search space, and the ``--fixed`` string that names one.

Degrees multiply to the world size: world = dp·tp·pp. Sequence parallelism lives inside the TP group;
ZeRO sharding runs over the data-parallel axis (degree dp). The global batch splits as
global_batch = dp·micro_batch·num_micro_batches.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from autoparallel.config.fields import integral

RECOMPUTE = ("none", "selective", "full")     # index = the integer code used by the vectorised cost model
SPLITS = ("even", "ends", "balanced")        # index = the integer code of the pipeline split


@dataclass(frozen=True, order=True)
class ParallelConfig:
    dp: int = 1                   # data-parallel degree (ZeRO shards over it)
    tp: int = 1                   # tensor-parallel degree (innermost ranks: inside a node when it fits)
    pp: int = 1                   # pipeline stages
    vpp: int = 1                  # virtual stages per device (interleaved schedule when > 1)
    sp: int = 0                   # 1: sequence parallelism inside the TP group
    sharding: int = 0             # ZeRO stage 0-3 over the data-parallel group
    recompute: str = "none"       # "none", "selective" (attention core) or "full" (whole block)
    offload: int = 0              # 1: optimizer states (and their update) live in host memory
    micro_batch: int = 1          # sequences per micro-batch per data-parallel replica
    ep: int = 1                   # expert-parallel degree (MoE models; carved out of the data-parallel ranks)
    split: str = "even"           # pipeline stage split: "even", "ends" (first/last one block lighter), "balanced"
    dualpipe: int = 0             # 1: DeepSeek's DualPipe schedule (rank r holds stages r and pp-1-r; planner-only:
                                  # the runtime runs 1F1B or VPP), see planner/dualpipe.py

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def schedule(self) -> str:
        if self.pp == 1:
            return "none"
        if self.dualpipe:
            return "DualPipe"
        return "VPP" if self.vpp > 1 else "1F1B"

    def num_micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)

    def to_dict(self) -> dict:
        return asdict(self)

    def short(self) -> str:
        """Compact text, e.g. 'dp=4 tp=8 pp=4 vpp=1 sp=1 zero=1 rc=selective off=0 mb=1'."""
        text = (f"dp={self.dp} tp={self.tp} pp={self.pp} vpp={self.vpp} sp={self.sp} zero={self.sharding} "
                f"rc={self.recompute} off={self.offload} mb={self.micro_batch}")
        if self.ep > 1:
            text += f" ep={self.ep}"
        if self.pp > 1 and self.split != "even":
            text += f" split={self.split}"
        if self.dualpipe:
            text += " dualpipe=1"
        return text

    def to_strategy_dict(self, global_batch: int) -> dict:
        """The configuration as ``Strategy.from_dict`` input (for auto_mode="full")."""
        m = self.num_micro_batches(global_batch)
        if self.dualpipe:
            raise NotImplementedError("the DualPipe schedule (dualpipe=1) is priced by the planner, but the runtime "
                                      "runs 1F1B or VPP only: constrain the search to dualpipe=0 to get a runnable "
                                      "plan")
        if self.ep > 1:
            raise NotImplementedError(f"expert parallelism (ep={self.ep}) is priced by the planner but the runtime "
                                      f"runs experts replicated: constrain the search to ep=1 to get a runnable plan")
        if self.pp > 1 and self.split != "even":
            raise NotImplementedError(f"the pipeline split {self.split!r} is priced by the planner, but a strategy "
                                      f"cannot carry it without the model's layer names: set "
                                      f"pipeline_parallel.split_points yourself, or constrain the search to "
                                      f"split='even' (what the runtime does by default)")
        return {
            "data_parallel": {"degree": self.dp},
            "tensor_parallel": {"degree": self.tp},
            "pipeline_parallel": {"degree": self.pp, "micro_batches": m if self.pp > 1 else None,
                                  "schedule": "VPP" if self.vpp > 1 else "1F1B", "vpp_degree": self.vpp},
            "sequence_parallel": {"enable": bool(self.sp)},
            "sharding": {"enable": self.sharding > 0, "stage": max(self.sharding, 1), "offload": bool(self.offload)},
            "recompute": {"enable": self.recompute != "none",
                          "granularity": "selective" if self.recompute == "selective" else "full"},
            "gradient_accumulation_steps": m if self.pp == 1 else 1,
            "micro_batch_size": self.micro_batch,
            "global_batch_size": global_batch,
        }


# --fixed keys -> (ParallelConfig field, allowed values or None for any positive integer)
FIXED_KEYS = {
    "dp": ("dp", None), "tp": ("tp", None), "pp": ("pp", None), "vpp": ("vpp", None),
    "sp": ("sp", (0, 1)), "sharding": ("sharding", (0, 1, 2, 3)), "offload": ("offload", (0, 1)),
    "micro_batch": ("micro_batch", None), "recompute": ("recompute", RECOMPUTE),
    "ep": ("ep", None), "split": ("split", SPLITS), "dualpipe": ("dualpipe", (0, 1)),
}


def parse_fixed(text) -> dict:
    """``"dp=4,tp=8,pp=4,micro_batch=1,recompute=selective,sharding=1"`` -> {field: value}.

    A dict is validated the same way. Keys: dp, tp, pp, vpp, sp 0|1, sharding 0-3, offload 0|1,
    micro_batch, recompute none|selective|full, ep, split even|ends|balanced, dualpipe 0|1. Raises ValueError
    naming the expected form.
    """
    if text is None:
        return {}
    if isinstance(text, ParallelConfig):
        return text.to_dict()
    if isinstance(text, dict):
        items = list(text.items())
    elif isinstance(text, str):
        items = []
        for item in text.split(","):
            if not item.strip():
                continue
            if "=" not in item:
                raise ValueError(f"malformed --fixed item {item.strip()!r}: expected KEY=VALUE with KEY one of "
                                 f"{', '.join(FIXED_KEYS)}")
            key, value = item.split("=", 1)
            items.append((key.strip(), value.strip()))
    else:
        raise TypeError(f"fixed must be a 'key=value,...' string or a dict, got {type(text).__name__}")
    out = {}
    for key, value in items:
        if key not in FIXED_KEYS:
            raise ValueError(f"unknown fixed key {key!r}: expected one of {', '.join(FIXED_KEYS)}")
        field_name, allowed = FIXED_KEYS[key]
        if field_name in ("recompute", "split"):
            if value not in allowed:
                raise ValueError(f"{field_name} must be one of {'|'.join(allowed)}, got {value!r}")
            out[field_name] = value
            continue
        number = _fixed_int(key, value)
        if allowed is not None and number not in allowed:
            raise ValueError(f"{key} must be one of {'|'.join(map(str, allowed))}, got {number}")
        if allowed is None and number <= 0:
            raise ValueError(f"{key} must be a positive integer, got {number}")
        out[field_name] = number
    return out


def _fixed_int(key: str, value) -> int:
    """An integer value of a --fixed key: text ("4") or an int (numpy's included); 2.5 or True are refused, not
    truncated."""
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{key} must be an integer, got {value!r}") from None
    number = integral(value)
    if number is None:
        raise ValueError(f"{key} must be an integer, got {type(value).__name__} {value!r}")
    return number


def config_from_fixed(fixed: dict, world: int) -> ParallelConfig:
    """Complete a parsed --fixed dict with defaults; dp defaults to world / (tp·pp)."""
    values = dict(fixed)
    tp, pp = values.get("tp", 1), values.get("pp", 1)
    if "dp" not in values:
        if world % (tp * pp):
            raise ValueError(f"tp·pp = {tp}·{pp} = {tp * pp} does not divide the {world} devices of the cluster")
        values["dp"] = world // (tp * pp)
    config = ParallelConfig(**values)
    if config.world != world:
        raise ValueError(f"dp·tp·pp = {config.dp}·{config.tp}·{config.pp} = {config.world}, but the cluster has "
                         f"{world} devices")
    return config


CONFIG_FIELDS = tuple(f.name for f in fields(ParallelConfig))
