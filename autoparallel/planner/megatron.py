"""Calibration against Megatron-LM's weak-scaling table (Narayanan et al., SC'21, Table 1).

The cost model has two efficiency constants (``PlannerOptions.gemm_efficiency`` and
``activation_traffic_factor``). They are fitted on TWO rows only, ``FIT_ROWS`` = the 1.7B row (the
smallest) and the 145B row; every other row is then a prediction.

Published configuration of each row: A100-80GB nodes of 8 (NVLink + HDR InfiniBand), TP x PP as
listed, dp = GPUs / (TP·PP), the listed global batch, sequence 2048, vocabulary 51200, full activation
recomputation, no ZeRO, no sequence parallelism (it came later), scatter/gather of stage-to-stage
messages over the TP group, the interleaved schedule (paper §5.1). Not in the table, so assumed:
  * micro-batch size 1 for every row (the paper's choice for its large pipelines, §3.2; with pp = 1
    the model is insensitive to it);
  * virtual stages per device v = the smallest v > 1 dividing a stage's layers (2 for most rows,
    3 for 76B's 15 and 530B's 3 layers per stage).
Software fact: the data-parallel all-reduce runs after the pipeline flush, not overlapped (``ROW_SOFTWARE``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoparallel.core.cluster import preset
from autoparallel.planner.config import ParallelConfig
from autoparallel.planner.model_spec import PRESETS
from autoparallel.planner.options import PlannerOptions


@dataclass(frozen=True)
class MegatronRow:
    model: str            # preset name (hidden, layers, heads as the paper reports them)
    tp: int               # tensor-parallel degree
    pp: int               # pipeline-parallel degree
    gpus: int             # total GPUs
    global_batch: int     # sequences per iteration
    tflops: float         # published TFLOP/s per GPU (with recomputation counted)


TABLE1 = (
    MegatronRow("megatron-1.7b", 1, 1, 32, 512, 137),
    MegatronRow("megatron-3.6b", 2, 1, 64, 512, 138),
    MegatronRow("megatron-7.5b", 4, 1, 128, 512, 142),
    MegatronRow("megatron-18b", 8, 1, 256, 1024, 135),
    MegatronRow("megatron-39b", 8, 2, 512, 1536, 138),
    MegatronRow("megatron-76b", 8, 4, 1024, 1792, 140),
    MegatronRow("megatron-145b", 8, 8, 1536, 2304, 148),
    MegatronRow("megatron-310b", 8, 16, 1920, 2160, 155),
    MegatronRow("megatron-530b", 8, 35, 2520, 2520, 163),
    MegatronRow("megatron-1t", 8, 64, 3072, 3072, 163),
)
FIT_ROWS = ("megatron-1.7b", "megatron-145b")     # the only rows the constants are fitted on
SEQ_LEN = 2048


def row_config(row: MegatronRow) -> ParallelConfig:
    """The published configuration of a row, with the stated assumptions for micro-batch and v."""
    layers = PRESETS[row.model].layers
    vpp = 1
    if row.pp > 1:
        per_stage = layers // row.pp
        vpp = min(v for v in range(2, per_stage + 1) if per_stage % v == 0)
    return ParallelConfig(dp=row.gpus // (row.tp * row.pp), tp=row.tp, pp=row.pp, vpp=vpp, sp=0, sharding=0,
                          recompute="full", offload=0, micro_batch=1)


def row_cluster(row: MegatronRow):
    return preset("A100-80GB", num_nodes=row.gpus // 8, devices_per_node=8)


ROW_SOFTWARE = {"grad_sync_overlap": False}       # Megatron-LM 2021 all-reduces after the pipeline flush


def predict_row(row: MegatronRow, options: PlannerOptions = None) -> dict:
    """Predicted figures of a row's published configuration (a dict like ``Candidate.to_dict()``)."""
    from autoparallel.planner.search import evaluate_config
    options = (options or PlannerOptions()).replace(**ROW_SOFTWARE)
    return evaluate_config(PRESETS[row.model], row_cluster(row), row.global_batch, SEQ_LEN, row_config(row),
                           options).to_dict()


def fit_constants(rows=FIT_ROWS, base: PlannerOptions = None):
    """(gemm_efficiency, activation_traffic_factor) that reproduce the published TFLOP/s of ``rows`` exactly."""
    from scipy.optimize import least_squares
    if len(rows) > 2:
        raise ValueError(f"the calibration fits at most two rows, got {len(rows)}: {rows}")
    base = base or PlannerOptions()
    by_name = {r.model: r for r in TABLE1}
    chosen = [by_name[name] for name in rows]

    def residuals(x):
        opts = base.replace(gemm_efficiency=float(x[0]), activation_traffic_factor=float(x[1]))
        return [predict_row(r, opts)["tflops_per_device"] / r.tflops - 1.0 for r in chosen]

    fit = least_squares(residuals, x0=[0.6, 2.0], bounds=([0.05, 0.0], [1.0, 50.0]), xtol=1e-12, ftol=1e-12)
    return float(fit.x[0]), float(fit.x[1])


def calibration_table(options: PlannerOptions = None) -> list:
    """Rows of (model, config, published, predicted, error) with the given (default: shipped) constants."""
    options = options or PlannerOptions()
    out = []
    for row in TABLE1:
        pred = predict_row(row, options)
        out.append({"model": row.model, "tp": row.tp, "pp": row.pp, "vpp": row_config(row).vpp, "gpus": row.gpus,
                    "global_batch": row.global_batch, "published": row.tflops,
                    "predicted": pred["tflops_per_device"], "error": pred["tflops_per_device"] / row.tflops - 1.0,
                    "fitted": row.model in FIT_ROWS, "memory_gb": pred["memory_per_device_gb"],
                    "feasible": pred["feasible"]})
    return out


def format_table(rows) -> str:
    lines = ["| model | TP x PP (v) | GPUs | batch | published TFLOP/s | predicted | error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        tag = " (fitted)" if r["fitted"] else ""
        lines.append(f"| {r['model']}{tag} | {r['tp']}x{r['pp']} ({r['vpp']}) | {r['gpus']} | {r['global_batch']} | "
                     f"{r['published']:.0f} | {r['predicted']:.1f} | {100 * r['error']:+.1f}% |")
    return "\n".join(lines)


def max_error(rows) -> float:
    return float(np.max([abs(r["error"]) for r in rows if not r["fitted"]]))
