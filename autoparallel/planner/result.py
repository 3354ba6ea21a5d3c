"""Candidate (one priced configuration) and PlanResult (what ``ap.plan`` returns)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from autoparallel.planner.config import ParallelConfig

GB = 1e9


@dataclass(frozen=True)
class Candidate:
    config: ParallelConfig        # the configuration
    global_batch: int             # sequences per step
    seq_len: int                  # tokens per sequence
    num_micro_batches: int        # micro-batches per step per data-parallel replica
    step_time_s: float            # predicted seconds per optimizer step
    tokens_per_s: float           # global_batch·seq_len / step_time_s
    tflops_per_device: float      # FLOPs counting recomputation (Megatron's count) per device per second / 1e12
    mfu: float                    # model FLOPs without recomputation / (step time · devices · peak)
    memory_gb: dict               # per-device memory breakdown in GB (params, grads, optimizer, activations, ...)
    memory_per_device_gb: float   # total of memory_gb (the stage that needs most)
    capacity_gb: float            # device memory capacity
    host_memory_gb: float         # optimizer states held in host memory per device (offload)
    time_s: dict                  # step time breakdown in seconds (compute, recompute, tp_comm, bubble, ...)
    feasible: bool                # fits in device memory (and, when offloading, in host memory)
    host_feasible: bool = True    # the node's host RAM holds what its devices offload
    stage_layers: tuple = ()      # blocks on the (first, last, largest middle) pipeline stage
    link_busy_s: dict = None      # seconds per step each link (nvlink, network, pcie) carries traffic

    @property
    def schedule(self) -> str:
        return self.config.schedule

    def to_dict(self) -> dict:
        c = self.config
        return {
            "dp": c.dp, "tp": c.tp, "pp": c.pp, "vpp": c.vpp, "sp": c.sp, "sharding_stage": c.sharding,
            "recompute": c.recompute, "offload": c.offload, "micro_batch_size": c.micro_batch,
            "num_micro_batches": self.num_micro_batches, "schedule": self.schedule,
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "tflops_per_device": self.tflops_per_device, "mfu": self.mfu,
            "memory_per_device_gb": self.memory_per_device_gb, "capacity_gb": self.capacity_gb,
            "memory_breakdown_gb": dict(self.memory_gb), "host_memory_gb": self.host_memory_gb,
            "time_breakdown_s": dict(self.time_s), "feasible": self.feasible,
            "host_feasible": self.host_feasible, "ep": c.ep, "split": c.split,
            "stage_layers": list(self.stage_layers), "link_busy_s": dict(self.link_busy_s or {}),
        }

    def to_strategy_dict(self) -> dict:
        return self.config.to_strategy_dict(self.global_batch)


_COLUMNS = ("#", "dp", "tp", "pp", "vpp", "split", "ep", "sp", "zero", "recompute", "off", "mb", "m", "step s",
            "tokens/s", "TFLOP/s", "MFU", "mem GB", "fits")


def _flops(tflops: float) -> str:
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.4f}"


def _row(rank, c: Candidate):
    k = c.config
    return (str(rank), str(k.dp), str(k.tp), str(k.pp), str(k.vpp), k.split if k.pp > 1 else "-", str(k.ep),
            str(k.sp), str(k.sharding), k.recompute,
            str(k.offload), str(k.micro_batch), str(c.num_micro_batches), f"{c.step_time_s:.3f}",
            f"{c.tokens_per_s:,.0f}", _flops(c.tflops_per_device), f"{100 * c.mfu:.1f}%",
            f"{c.memory_per_device_gb:.1f}", "yes" if c.feasible else "NO")


def format_candidates(candidates) -> str:
    rows = [_COLUMNS] + [_row(i + 1, c) for i, c in enumerate(candidates)]
    widths = [max(len(r[j]) for r in rows) for j in range(len(_COLUMNS))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@dataclass
class PlanResult:
    model: object                 # ModelSpec planned for
    cluster: object               # ClusterSpec planned for
    global_batch_size: int        # sequences per step
    seq_len: int                  # tokens per sequence
    candidates: list              # ranked Candidates, best first (for a fixed configuration: just it)
    explanation: str              # why the winner beats the runners-up, or what would make the request fit
    feasible: bool                # at least one candidate fits
    evaluated: int                # configurations priced
    seconds: float                # planning wall time
    mode: str = "search"          # "search" or "fixed"
    reference: Candidate = None   # with mode "fixed": the best configuration the search finds, for comparison
    suggestions: list = field(default_factory=list)   # smallest changes that make an infeasible request fit

    @property
    def best(self) -> Candidate:
        return self.candidates[0] if self.candidates else None

    def table(self) -> str:
        return format_candidates(self.candidates)

    def __str__(self) -> str:
        seq = f"seq {self.seq_len}" if self.seq_len else "sequence length not given"
        head = (f"plan: {self.model.name} on {self.cluster.name} ({self.cluster.world_size} devices), "
                f"global batch {self.global_batch_size}, {seq}; {self.evaluated} configurations "
                f"priced in {self.seconds:.2f} s")
        parts = [head]
        if self.candidates:
            parts.append(self.table())
        parts.append(self.explanation)
        return "\n\n".join(p for p in parts if p)

    def print(self) -> None:
        print(str(self))

    def to_dict(self) -> dict:
        return {
            "model": self.model.name, "cluster": self.cluster.name, "devices": self.cluster.world_size,
            "global_batch_size": self.global_batch_size, "seq_len": self.seq_len, "mode": self.mode,
            "feasible": self.feasible, "evaluated": self.evaluated, "planning_seconds": self.seconds,
            "candidates": [c.to_dict() for c in self.candidates],
            "reference": self.reference.to_dict() if self.reference is not None else None,
            "explanation": self.explanation, "suggestions": list(self.suggestions),
        }

    def to_json(self, path: str = None, indent: int = 2) -> str:
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text
