"""Validation against published large-scale training runs (none of them used to fit anything).

Each run: the model's shape, the GPU type and count, the fabric, the published parallel configuration and
the reported throughput, with its source. ``validation_table`` prices every run's published configuration
with the shipped constants (fitted on two rows of Megatron-LM's Table 1 only, planner/megatron.py) and
reports predicted / published. Where a paper leaves a knob out, the assumption is written next to it and was fixed
before looking at the prediction: micro-batch 1 unless published; interleaving off unless published (LLaMA 3: V =
8, derived from §3.3.2's chunk layout, see its notes); ZeRO-1 for the Megatron-DeepSpeed runs. Korthikanti et al.'s
four runs are as the paper states them: micro-batch sizes from Table 3 (22B: 4, the others 1) and interleaving with
m = 3 for the 175B and 530B models only (§6: "We use the interleaving schedule with three interleaving stages (m =
3) for the 175B and 530B models"), so the 1T model runs plain 1F1B. Software facts are per run (``software``):
DeepSpeed's pipeline engine partitions the activation it sends, and the gradient it returns, over the
tensor-parallel group (runtime/pipe/engine.py: ``is_pipe_partitioned = is_grad_partitioned = is_model_parallel``,
PartitionedTensor over the slice-parallel group, re-assembled by an all-gather on arrival; later versions keep it
as the ``pipe_partitioned``/``grad_partitioned`` defaults), i.e. the same scatter/gather as Megatron-LM's, and runs
each schedule step's send and receive one after the other with blocking calls (runtime/pipe/schedule.py, p2p.py);
FlashAttention (2022+) in the 2024 runs.

Metrics: "tflops" = TFLOP/s per GPU counting recomputation (Megatron / Megatron-DeepSpeed reporting),
"mfu" = model FLOPs utilisation (no recomputation), "tokens" = tokens/s per GPU. A run whose framework counted
its TFLOP/s another way names that count (``flop_counter``, ``FLOP_COUNTERS``): the prediction is converted to
the same count, tokens/s/GPU x the counter's FLOPs per token, never the published figure re-scaled.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from autoparallel.core.cluster import DEVICES, cluster_of
from autoparallel.planner import fp8
from autoparallel.planner.config import ParallelConfig
from autoparallel.planner.model_spec import PRESETS
from autoparallel.planner.options import PlannerOptions
from autoparallel.core.topology import Topology

GB = 1e9
# DeepSpeed's pipeline engine partitions stage-to-stage activations and gradients over the TP group when TP > 1
# (runtime/pipe/engine.py is_pipe_partitioned / is_grad_partitioned, PartitionedTensor.full() all-gathers on arrival)
# and runs a step's transfers one after the other, blocking (schedule.py TrainSchedule, p2p.py);
# DeepSpeed's pipeline engine and Megatron-LM (2021-22) reduce gradients after the pipeline drains (no overlap);
# gradient bucket sizes of the runs' frameworks (defaults): DeepSpeed reduce_bucket_size 5e8 elements (fp32);
# Megatron-LM DDP 40M elements; FSDP one reduce-scatter per wrapped block (OPT: 175B/96 blocks/TP 8 = 228M
# parameters; LLaMA 3 405B: 405B/126/8 = 400M parameters), all fp32
_DEEPSPEED = (("pp_scatter_gather", True), ("pp_serial_p2p", True), ("grad_bucket_bytes", 2e9),
              ("grad_sync_overlap", False))
_MEGATRON = (("grad_bucket_bytes", 160e6), ("grad_sync_overlap", False))
_HDR = Topology(nics_per_node=8, nic_bandwidth_Bps=25 * GB, host_memory_bytes=2e12, pcie_bandwidth_Bps=12 * GB)
# Jean Zay (BLOOM): 4 Omni-Path 100 Gb/s links per node, 512 GB host RAM
_OPA = Topology(nics_per_node=4, nic_bandwidth_Bps=12.5 * GB, host_memory_bytes=512e9, pcie_bandwidth_Bps=12 * GB)
# GPT-NeoX-20B's cluster: four ConnectX-6 HDR HCAs per node shared by 8 GPUs
_NEOX = Topology(nics_per_node=4, nic_bandwidth_Bps=25 * GB, host_memory_bytes=512e9, pcie_bandwidth_Bps=12 * GB)
# Meta's RoCE cluster (LLaMA 3): 400 Gb/s per GPU, 3-layer Clos, AI zones of 3072 GPUs joined 1:7 oversubscribed
_ROCE = Topology(nics_per_node=8, nic_bandwidth_Bps=50 * GB, nodes_per_leaf=384, oversubscription=7.0,
                 host_memory_bytes=2e12, pcie_bandwidth_Bps=25 * GB)
# GPT-NeoX's own counter (EleutherAI/gpt-neox megatron/logging.py ``get_flops`` until PR #1044, Sept 2023, i.e.
# when GPT-NeoX-20B was trained and reported): 6·total_params + 60·s·h·l FLOPs per token, no recomputation factor
FLOP_COUNTERS = {
    "gpt-neox": lambda model, s: 6.0 * model.params + 60.0 * s * model.hidden * model.layers,
}
# DeepSpeed's fp16 engine accumulates gradients in the fp16 .grad and ZeRO-1 reduces them in fp16
# (communication_data_type defaults to the model's dtype); no fp32 accumulation buffer
_DEEPSPEED_FP16 = (("grad_accum_fp32", False),)
_NDR = Topology(nics_per_node=8, nic_bandwidth_Bps=50 * GB, host_memory_bytes=2e12, pcie_bandwidth_Bps=25 * GB)
# MegaScale's cluster (Jiang et al. 2024 §3.6): eight 200 Gb/s NICs per server, each on a different ToR switch
# (multi-rail), three switch layers at 1:1 downlink:uplink (non-blocking); host RAM and PCIe not published (as _HDR)
_MEGASCALE = Topology(nics_per_node=8, nic_bandwidth_Bps=25 * GB, host_memory_bytes=2e12, pcie_bandwidth_Bps=12 * GB)
# Megatron-LM at commit 285068c8 (Jan 2023, the sweep's baseline): --use-flash-attn, --sequence-parallel,
# --use-distributed-optimizer and recomputation exist but are off unless asked for; the gradient reduction
# (all-reduce, or the distributed optimizer's reduce-scatter) runs after the backward, no overlap option
# (megatron/arguments.py at that commit)
_MEGASCALE_SWEEP_NOTES = (
    "TP 8, PP 8, 6 interleaved stages, DP = GPUs/64 (paper Table 1, §6.1). Assumed (fixed before pricing): "
    "micro-batch 1; sequence parallelism + selective recomputation (Korthikanti et al.'s recipe: without them "
    "~0.66 GB of activations per block per micro-batch, ~73 GB in flight on the first stage); Megatron's "
    "distributed optimizer (ZeRO-1); no FlashAttention (off by default at 285068c8; FlashAttention-2 is "
    "MegaScale's own change, §3.3); A100-80GB (the paper says 'NVIDIA Ampere'; its MFU arithmetic implies a "
    "312 TFLOP/s peak); 8 x 200 Gb/s NICs per node, non-blocking Clos (§3.6)")


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: str                    # preset (planner/model_spec.py)
    device: str                   # cluster preset device
    gpus: int
    topology: Topology
    config: ParallelConfig        # the published parallel configuration (assumptions noted in ``notes``)
    global_batch: int             # sequences per step
    seq_len: int
    metric: str                   # "tflops", "mfu" or "tokens"
    published: float
    source: str
    notes: str = ""
    precision: str = "bf16"
    dense_only: bool = field(default=True)   # False: a MoE run (the runtime has no expert parallelism yet)
    software: tuple = ()          # PlannerOptions facts of the run's software, e.g. (("flash_attention", True),)
    flop_counter: str = None      # "tflops" counted the framework's way (FLOP_COUNTERS); None: Megatron's count

    def options(self, base: PlannerOptions = None) -> PlannerOptions:
        return (base or PlannerOptions()).replace(precision=self.precision, **dict(self.software))


def _cfg(gpus, tp, pp, **kw):
    return ParallelConfig(dp=gpus // (tp * pp), tp=tp, pp=pp, **kw)


RUNS = (
    PublishedRun("BLOOM-176B", "bloom-176b", "A100-80GB", 384, _OPA,
                 _cfg(384, 4, 12, sharding=1, recompute="full", micro_batch=2, split="ends"), 2048, 2048,
                 "tflops", 150.0, "Le Scao et al. 2022 (arXiv:2211.05100) §3.4; BigScience tr11-176B-ml.slurm and README",
                 "ZeRO-1, embedding counted as a block at each end of the pipeline (Megatron-DeepSpeed partitioning); "
                 "4 Omni-Path 100 Gb/s links per node",
                 software=_DEEPSPEED),
    PublishedRun("OPT-175B", "opt-175b", "A100-80GB", 992, _HDR,
                 _cfg(992, 8, 1, sharding=3, recompute="full", micro_batch=8), 992, 2048,
                 "tflops", 147.0, "Zhang et al. 2022 (arXiv:2205.01068) §2.4",
                 "FSDP (ZeRO-3) + TP 8; batch 2M tokens taken as 992 sequences (8 per replica, one micro-batch)",
                 software=(("grad_bucket_bytes", 0.9e9),)),
    PublishedRun("GPT-NeoX-20B", "gpt-neox-20b", "A100-40GB", 96, _NEOX,
                 _cfg(96, 2, 4, sharding=1, recompute="full", micro_batch=4), 1536, 2048,
                 "tflops", 117.0, "Black et al. 2022 (arXiv:2204.06745) §3.1",
                 "TP 2, PP 4, ZeRO-1, micro-batch 4 x 32 accumulation steps, no dropout, fp16 (the released "
                 "configs/20B.yml); 4 HDR HCAs per node of 8 A100-SXM4 (NVLink); TFLOP/s by GPT-NeoX's counter "
                 "(6·params + 60·s·h·l per token)",
                 software=_DEEPSPEED + _DEEPSPEED_FP16, flop_counter="gpt-neox"),
    PublishedRun("MT-NLG 530B (2240)", "mt-nlg-530b", "A100-80GB", 2240, _HDR,
                 _cfg(2240, 8, 35, sharding=1, recompute="full"), 1920, 2048,
                 "tflops", 126.0, "Smith et al. 2022 (arXiv:2201.11990) §2.4: 60.1 s/iteration",
                 "DeepSpeed pipeline engine (1F1B, messages partitioned over TP, serial blocking transfers), ZeRO-1", software=_DEEPSPEED),
    PublishedRun("MT-NLG 530B (2800)", "mt-nlg-530b", "A100-80GB", 2800, _HDR,
                 _cfg(2800, 8, 35, sharding=1, recompute="full"), 1920, 2048,
                 "tflops", 121.0, "Smith et al. 2022 §2.4: 50.2 s/iteration",
                 "DeepSpeed pipeline engine (1F1B, messages partitioned over TP, serial blocking transfers), ZeRO-1", software=_DEEPSPEED),
    PublishedRun("MT-NLG 530B (3360)", "mt-nlg-530b", "A100-80GB", 3360, _HDR,
                 _cfg(3360, 8, 35, sharding=1, recompute="full"), 1920, 2048,
                 "tflops", 113.0, "Smith et al. 2022 §2.4: 44.4 s/iteration",
                 "DeepSpeed pipeline engine (1F1B, messages partitioned over TP, serial blocking transfers), ZeRO-1", software=_DEEPSPEED),
    PublishedRun("GPT 22B (SP+selective)", "gpt-22b", "A100-80GB", 8, _HDR,
                 _cfg(8, 8, 1, sp=1, recompute="selective", micro_batch=4), 4, 2048,
                 "mfu", 0.415, "Korthikanti et al. 2023 (MLSys, arXiv:2205.05198) Tables 3 and 5: 1.10 s",
                 "micro-batch 4 (Table 3): one micro-batch per step", software=_MEGATRON),
    PublishedRun("GPT-3 175B (SP+selective)", "gpt3-175b", "A100-80GB", 64, _HDR,
                 _cfg(64, 8, 8, vpp=3, sp=1, recompute="selective"), 64, 2048,
                 "mfu", 0.514, "Korthikanti et al. 2023 Tables 3 and 5: 13.75 s",
                 "micro-batch 1 (Table 3); interleaved, m = 3 (§6)", software=_MEGATRON),
    PublishedRun("MT-NLG 530B (SP+selective)", "megatron-530b", "A100-80GB", 280, _HDR,
                 _cfg(280, 8, 35, vpp=3, sp=1, recompute="selective"), 280, 2048,
                 "mfu", 0.560, "Korthikanti et al. 2023 Tables 3 and 5: 37.83 s",
                 "micro-batch 1 (Table 3); interleaved, m = 3 (§6)", software=_MEGATRON),
    PublishedRun("GPT 1T (SP+selective)", "megatron-1t", "A100-80GB", 512, _HDR,
                 _cfg(512, 8, 64, sp=1, recompute="selective"), 512, 2048,
                 "mfu", 0.563, "Korthikanti et al. 2023 Tables 3 and 5: 71.49 s",
                 "micro-batch 1 (Table 3); not interleaved (§6 interleaves the 175B and 530B models only)",
                 software=_MEGATRON),
    PublishedRun("LLaMA 3 405B (8192)", "llama3-405b", "H100-80GB", 8192, _ROCE,
                 _cfg(8192, 8, 16, vpp=8, sp=1, sharding=2, split="ends"), 2048, 8192,
                 "mfu", 0.43, "Dubey et al. 2024 (arXiv:2407.21783) Table 4: 430 TFLOP/s, 43% BF16 MFU",
                 "first/last stage one block fewer, no activation checkpointing, FSDP sharding optimizer states and "
                 "gradients but not the weights (ZeRO-2), fp32 gradient accumulation (paper §3.3.2); V = 8 from "
                 "§3.3.2 (one block fewer on the first stage leaves its first chunk with only the embedding, so a "
                 "chunk holds one block: 126 + 2 = 16 x 8); micro-batch 1 and Megatron-LM's in-flight count assumed "
                 "(N not stated); FlashAttention; RoCE Clos with 1:7 oversubscription above 3072-GPU zones",
                 software=(("flash_attention", True), ("grad_bucket_bytes", 1.6e9))),
    PublishedRun("LLaMA 3 405B (16384)", "llama3-405b", "H100-80GB", 16384, _ROCE,
                 _cfg(16384, 8, 16, vpp=8, sp=1, sharding=2, split="ends"), 2048, 8192,
                 "mfu", 0.41, "Dubey et al. 2024 Table 4: 400 TFLOP/s, 41% BF16 MFU",
                 "as the 8192-GPU row, DP 128",
                 software=(("flash_attention", True), ("grad_bucket_bytes", 1.6e9))),
)


def _megascale_sweep(gpus: int, global_batch: int, mfu: float) -> PublishedRun:
    """One Megatron-LM row of MegaScale's strong-scaling sweep of a 175B model (Jiang et al. 2024, Table 2)."""
    notes = _MEGASCALE_SWEEP_NOTES if gpus == 256 else f"as the 256-GPU row, DP {gpus // 64}, batch {global_batch}"
    return PublishedRun(f"Megatron-LM 175B sweep ({gpus})", "megascale-175b", "A100-80GB", gpus, _MEGASCALE,
                        _cfg(gpus, 8, 8, vpp=6, sp=1, sharding=1, recompute="selective"), global_batch, 2048,
                        "mfu", mfu, "Jiang et al. 2024 (MegaScale, NSDI '24, arXiv:2402.15627) Table 2, Megatron-LM "
                        "rows; model and configuration Table 1 and §6.1", notes, software=_MEGATRON)


# the Megatron-LM baseline of MegaScale's sweep (Table 2): batch 768 on 256-1024 GPUs ("GPU memory limit"),
# 6144 on 3072-12288 GPUs; MegaScale's own rows (parallel block, sliding-window attention, LAMB) are another model
MEGASCALE_SWEEP = tuple(_megascale_sweep(g, b, m) for g, b, m in (
    (256, 768, 0.530), (512, 768, 0.499), (768, 768, 0.467), (1024, 768, 0.447),
    (3072, 6144, 0.487), (6144, 6144, 0.478), (8192, 6144, 0.433), (12288, 6144, 0.412)))
RUNS = RUNS + MEGASCALE_SWEEP

_MEGASCALE_530B_NOTES = (
    "TP 8, PP 35, 3 interleaved stages, DP = GPUs/280, batch = GPUs (paper Table 1, §6.1, Figure 9). Assumed "
    "(fixed before pricing, as the 175B sweep): micro-batch 1; sequence parallelism + selective recomputation; "
    "Megatron's distributed optimizer (ZeRO-1); no FlashAttention; A100-80GB; 8 x 200 Gb/s NICs per node, "
    "non-blocking Clos (§3.6)")


def _megascale_530b(gpus: int, mfu: float) -> PublishedRun:
    """One Megatron-LM point of MegaScale's weak-scaling runs of a 530B model (Jiang et al. 2024, Figure 9)."""
    notes = _MEGASCALE_530B_NOTES if gpus == 2240 else f"as the 2240-GPU row, DP {gpus // 280}, batch {gpus}"
    return PublishedRun(f"Megatron-LM 530B weak scaling ({gpus})", "megascale-530b", "A100-80GB", gpus, _MEGASCALE,
                        _cfg(gpus, 8, 35, vpp=3, sp=1, sharding=1, recompute="selective"), gpus, 2048,
                        "mfu", mfu, "Jiang et al. 2024 (MegaScale, arXiv:2402.15627) Figure 9, Megatron-LM labels; "
                        "model and configuration Table 1 and §6.1", notes, software=_MEGATRON)


# the Megatron-LM points of MegaScale's weak scaling (Figure 9's labels: 49.2 / 48.8 / 48.2% MFU; the batch grows
# with the GPU count, so every point has 280 micro-batches per pipeline)
MEGASCALE_530B = tuple(_megascale_530b(g, m) for g, m in ((2240, 0.492), (4480, 0.488), (11200, 0.482)))
RUNS = RUNS + MEGASCALE_530B

# DeepSeek-V3's software facts (arXiv:2412.19437): FlashAttention-style attention; the expert all-to-all hidden by
# DualPipe (§3.2.1; the schedule itself, its time and memory, is the configuration's dualpipe=1); "Recomputation of
# RMSNorm and MLA Up-Projection" (§3.2.3); "cache activations in FP8 format for the backward pass of the Linear
# operator", the Linear-after-attention inputs in "a customized E5M6 data format" (12 bits), the MoE SwiGLU's inputs
# cached and its output recomputed, "the BF16 data format instead of FP32 to track the first and second moments in the
# AdamW optimizer" (§3.3.3); its EMA lives in CPU memory (§3.2.3: nothing on the device, and the planner counts none);
# the all-to-all and PP kernels hold 20 of the H800's 132 SMs (§3.2.2, §3.5.1), so compute runs on the other 112;
# its fine-grained FP8 GEMMs (§3.3.2) at the rates DeepGEMM measured on the H800 at its shapes (planner/fp8.py)
_DEEPSEEK_V3 = (("flash_attention", True), ("moe_a2a_overlap", True), ("recompute_norm_up_projection", True),
                ("linear_input_bytes", 1.0), ("attention_output_bytes", 1.5), ("moe_swiglu_recompute", True),
                ("optimizer_moment_bytes", 2.0), ("comm_sm_fraction", 20 / 132),
                ("linear_gemm_efficiency", fp8.measured_efficiency(PRESETS["deepseek-v3"], fp8.DEEPGEMM_H800,
                                                                   DEVICES["H800"].flops("float8"))))

MOE_RUNS = (
    PublishedRun("DeepSeek-V3", "deepseek-v3", "H800", 2048, _NDR,
                 _cfg(2048, 1, 16, sharding=1, ep=64, split="ends", dualpipe=1), 15360, 4096,
                 "tokens", 1543.0, "DeepSeek-AI 2024 (arXiv:2412.19437): 180K H800 GPU hours per trillion tokens "
                 "(14.8T tokens in 2.664M GPU hours)",
                 "FP8 for the linear layers' GEMMs, attention core, router and output head in BF16 (§3.3.1); MLA from "
                 "its ranks and head widths (§2.1.1, config.json); MTP depth 1 (§2.2); PP 16 under DualPipe (§3.2.1: "
                 "its bubble, rank r running stages r and PP-1-r, the all-to-all overlapped; 2 blocks on each end "
                 "stage assumed), EP 64, node-limited routing (4 nodes), ZeRO-1; memory as stated: DualPipe's 2 weight"
                 " and gradient copies and PP+1 activations (§3.2.1), RMSNorm and MLA up-projections recomputed "
                 "(§3.2.3), Linear inputs cached in FP8 (E5M6 after attention), MoE SwiGLU output recomputed, BF16 "
                 "Adam moments (§3.3.3); communication kernels on 20 of the 132 SMs (§3.2.2, §3.5.1)",
                 precision="fp8", dense_only=False, software=_DEEPSEEK_V3),
)


def run_cluster(run: PublishedRun):
    return cluster_of(run.device, run.gpus, run.topology)


def predict(run: PublishedRun, options: PlannerOptions = None):
    """The planner's Candidate for the run's published configuration."""
    from autoparallel.planner.search import evaluate_config, invalid_reason

    options = run.options(options)
    model = PRESETS[run.model]
    cluster = run_cluster(run)
    reason = invalid_reason(model, cluster.world_size, run.global_batch, run.seq_len, run.config, options)
    if reason is not None:
        raise ValueError(f"{run.name}: the published configuration is invalid for the planner: {reason}")
    return evaluate_config(model, cluster, run.global_batch, run.seq_len, run.config, options)


def metric_of(run: PublishedRun, cand) -> float:
    if run.metric == "tflops" and run.flop_counter is not None:
        per_token = FLOP_COUNTERS[run.flop_counter](PRESETS[run.model], run.seq_len)
        return cand.tokens_per_s * per_token / run.gpus / 1e12
    if run.metric == "tflops":
        return cand.tflops_per_device
    if run.metric == "mfu":
        return cand.mfu
    return cand.tokens_per_s / run.gpus


def validation_table(runs=RUNS, options: PlannerOptions = None) -> list:
    out = []
    for run in runs:
        cand = predict(run, options)
        pred = metric_of(run, cand)
        out.append({"name": run.name, "gpus": run.gpus, "global_batch": run.global_batch, "device": run.device, "config": run.config.short(),
                    "metric": run.metric, "published": run.published, "predicted": pred,
                    "ratio": pred / run.published, "feasible": cand.feasible,
                    "memory_gb": cand.memory_per_device_gb, "step_time_s": cand.step_time_s, "source": run.source})
    return out


def search_best(run: PublishedRun, options: PlannerOptions = None, feasible_only: bool = True):
    """The search's best configuration for the run's job (same model, GPUs, batch, sequence): the fastest that
    fits, or with ``feasible_only=False`` the fastest of all (for a published configuration that the memory
    model says does not fit). A run that used DualPipe lets the search choose it too (``SearchSpace.dualpipe``)."""
    from autoparallel.planner.search import SearchSpace, candidate_at, rank_order, search

    options = run.options(options)
    cluster = run_cluster(run)
    # the search may use the run's own schedule: DualPipe is searched only when asked for (planner-only)
    space = SearchSpace(dualpipe=(0, 1)) if run.config.dualpipe else SearchSpace()
    outcome = search(PRESETS[run.model], cluster, run.global_batch, run.seq_len, space, options,
                     prune=feasible_only)
    order = outcome.order if feasible_only else rank_order(outcome.evaluation, outcome.grid, feasible_only=False)
    if not len(order):
        return None
    return candidate_at(outcome.evaluation, outcome.grid, int(order[0]), run.global_batch, run.seq_len,
                        cluster.device.memory_bytes)


def drift(rows) -> float:
    """Slope of predicted/published against log2(GPU count) (0: no drift with scale)."""
    x = np.log2([r["gpus"] for r in rows])
    y = np.array([r["ratio"] for r in rows])
    return float(np.polyfit(x, y, 1)[0])


def format_table(rows) -> str:
    unit = {"tflops": "TFLOP/s/GPU", "mfu": "MFU", "tokens": "tokens/s/GPU"}
    lines = ["| run | GPUs | configuration | metric | published | predicted | ratio | fits |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fmt = (lambda x: f"{100 * x:.1f}%") if r["metric"] == "mfu" else (lambda x: f"{x:.1f}")
        lines.append(f"| {r['name']} | {r['gpus']} | {r['config']} | {unit[r['metric']]} | {fmt(r['published'])} | "
                     f"{fmt(r['predicted'])} | {r['ratio']:.3f} | {'yes' if r['feasible'] else 'NO'} |")
    return "\n".join(lines)
