"""Sections of docs/planner.md written by tools/bench/planner.py: validation against published runs (with the
ratio-vs-GPU-count plot) and the cost model's description with its sources."""
from __future__ import annotations

import os

import numpy as np

from autoparallel.planner import published
from autoparallel.planner.cluster import DEVICES, _LINKS


def plot_validation(rows, moe_rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 5))
    series = {}                                   # a sweep of one model ("name (GPUs)") is a line with a legend entry
    for r in rows:
        base = r["name"].rsplit(" (", 1)[0]
        if base.startswith("Megatron-LM "):
            series.setdefault(base, []).append(r)
            continue
        ax.scatter(r["gpus"], r["ratio"], color="#4c72b0")
        ax.annotate(r["name"], (r["gpus"], r["ratio"]), fontsize=7, xytext=(4, 2), textcoords="offset points")
    for (base, pts), color in zip(series.items(), ("#55a868", "#8172b2", "#ccb974")):
        batches = sorted({p["global_batch"] for p in pts})         # strong scaling: one line per batch size
        parts = [[p for p in pts if p["global_batch"] == b] for b in batches] if len(batches) < len(pts) else [pts]
        for i, part in enumerate(parts):
            ax.plot([p["gpus"] for p in part], [p["ratio"] for p in part], "o-", color=color, ms=5,
                    label=base if i == 0 else None)
    for r in moe_rows:
        ax.scatter(r["gpus"], r["ratio"], color="#c44e52", marker="^")
        ax.annotate(r["name"] + " (MoE)", (r["gpus"], r["ratio"]), fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="k", lw=0.8)
    for y in (0.85, 1.15):
        ax.axhline(y, color="grey", lw=0.6, ls="--")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("predicted / published")
    ax.set_title("Planner vs published training runs (fixed mode, nothing fitted on them)")
    if series:
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _misses(rows) -> str:
    out = [r for r in rows if abs(r["ratio"] - 1) > 0.15]
    if not out:
        return "Every dense run is within 15%."
    names = ", ".join(f"{r['name']} ({100 * (r['ratio'] - 1):+.1f}%)" for r in out)
    return (f"**The 15% target is not met for every run**: {names}; see \"Third pass\" and \"Fourth pass\" below for "
            f"what was checked and why they stay.")


def validation_md(rows, moe_rows, search_rows, png, out):
    errors = [abs(r["ratio"] - 1) for r in rows]
    within = sum(e <= 0.15 for e in errors)
    slope = published.drift(rows)
    sources = _table(("run", "source", "assumptions / software"),
                     [(r.name, r.source, r.notes or "as published") for r in published.RUNS + published.MOE_RUNS])
    rel_png = os.path.relpath(png, os.path.dirname(out))
    return f"""## Validation against published training runs

Every run's published configuration priced in fixed mode (`autoparallel.planner.published`, test
`tests/test_planner_published.py`). Nothing is fitted on these runs: the two constants come from Megatron-LM
Table 1 (above). Where a paper leaves a knob out, the assumption was fixed before looking at the prediction and
is listed with the sources. Some per-run facts were added after a first look, and that pass is reported too
(6 of the 12 dense runs within 15%, largest error 23.7%, the LLaMA 3 rows unpriceable without FlashAttention):
FlashAttention for the 2024 runs; the frameworks' documented behaviour, i.e. DeepSpeed's pipeline engine (which
the first three passes priced with whole activations between stages; the fourth pass found it partitions them over
the TP group) and, like Megatron-LM in 2021-22, reduces gradients after the pipeline drains
(not overlapped; the calibration rows got the same fact and the two constants were refitted on the same two
rows), and each framework's gradient bucket size; for Korthikanti et al.'s three pipelined runs the calibration's
own interleaving rule (v = the smallest v > 1 dividing a stage) instead of none (first pass 0.91, 0.88, 0.88), until
the fifth pass read the paper's own configurations (micro-batch sizes, which runs were interleaved; below).
None of these is a fitted number. The MoE run (red in the plot) is outside the dense statistics.

{published.format_table(rows + moe_rows)}

Dense runs: {within} of {len(rows)} within 15%, largest error {100 * max(errors):.1f}%, mean ratio
{np.mean([r['ratio'] for r in rows]):.3f}; drift of the ratio with scale {slope:+.4f} per doubling of the GPU count
(8 to 16,384 GPUs). {_misses(rows)}
One published configuration does not fit in memory by the model: LLaMA 3 405B (71 GB of activations on a stage of
8 blocks, no recomputation as the paper states, with Megatron-LM's count of in-flight micro-batches, where Meta's
own schedule kept fewer; "Fifth pass" below). GPT 1T, which the earlier passes called infeasible with an assumed
interleaving the paper did not use, fits as published. The LLaMA 3 rows are priced with the V = 8 virtual stages
their paper implies (they were 1.000 and 0.870 with an assumed v = 2, whose bubble was 47% of the 16,384-GPU step);
with them the drift rises from +0.0025 to +0.0080 per doubling and the large runs' mean ratio from 1.055 to 1.085
(small runs 0.998 → 0.999), both still within the targets (0.01 and 0.10). DeepSeek-V3
(MoE, fp8, DualPipe) is priced with what the paper states of its shapes and numerics (arXiv:2412.19437 and the
released config.json; "Mixture of experts" below): MLA from its ranks and head widths (was multi-head attention of
width 7168), the multi-token-prediction module of depth 1, and fp8 for the linear layers' GEMMs only, the attention
core, the router and the output head at the bf16 rate (was every matmul at the fp8 rate). The ratio moved, item by
item: 1.542 (before) -> 1.416 (MLA) -> 1.484 (MTP) -> 1.409 (each stage's overlapped communication against its own
compute, which MTP exposed: the last stage had most compute while the 5-block middle stage exposed 1.7 s of
all-to-all; the dense runs did not move) -> 1.053 (fp8 per GEMM class). Nothing was fitted; what was left unmodelled
then was large on this run: DualPipe's time (then priced as 1F1B with the all-to-all overlapped; now priced from
Table 2 with rank r running stages r and PP−1−r, "DualPipe" below: 1.034 -> 1.402; then the 20 SMs the
communication kernels hold, "Communication's SMs" below: 1.402 -> 1.286; then a rank's gradient sums and
optimizer step covering both its stages, "DualPipe" below: 1.286 -> 1.271; then FP8's quantization passes, "FP8's
quantization passes" below: 1.271 -> 1.237), the pipeline split (assumed 2
blocks at each end: under 1F1B the last stage, 2 blocks plus two bf16 output-head passes and the MTP block, set the
pace; with the balanced split the ratio would have been 1.22, without MTP 1.28), fp8's fine-grained scaling and FP32
promotion of partial sums (§3.3.2; fp8 GEMMs run at the bf16 runs' efficiency here), dense and MoE blocks averaged
per stage, and causal attention priced over all s keys (as for every run). With the all-to-all exposed instead of
overlapped the ratio would be 0.75.

DeepSeek-V3's memory is priced with what the paper states (arXiv:2412.19437 §3.2.1 Table 2, §3.2.3, §3.3.3;
`PlannerOptions` fields set in the run's `software`, off for every other run; "Memory" below). Per GPU on the stage
that needs most (a middle one: 5 blocks, 1F1B's 15 micro-batches in flight), item by item: 163.6 GB before (137.9 GB
of activations) -> 161.9 ("the BF16 data format instead of FP32 to track the first and second moments in the AdamW
optimizer": optimizer states 12 -> 8 B/param, over ZeRO-1's 128) -> 131.9 ("cache activations in FP8 format for the
backward pass of the Linear operator", the inputs of the Linear after attention in "a customized E5M6 data format")
-> 115.9 ("we cache the inputs of the SwiGLU operator and recompute its output in the backward pass", MoE blocks)
-> 71.3, fits ("We recompute all RMSNorm operations and MLA up-projections during back-propagation": MLA's Q, K, V
and the normed copies not stored) -> 85.3 GB, **does not fit** (DualPipe: rank r holds stages r and PP−1−r,
"two copies of the model parameters" over the pipeline, and Table 2's PP+1 stage-micro-batches of activations; the
fullest ranks, 2 and 13, hold the 5-block stage 2 with 14 micro-batches in flight and the 4-block stage 13 with 3:
7.5 GB of weights, 15.0 GB of fp32 gradients, 3.1 GB of optimizer states, 51.7 GB of activations). "Exponential Moving Average in CPU" changes nothing: the EMA is in host
memory and the planner never counted it. "Shared Embedding and Output Head for Multi-Token Prediction" changes
nothing either: the planner already counts one embedding and one head (the MTP module adds no copy). The ratio
moved 1.053 -> 1.034, by the recomputation's time alone (1.053 -> 1.051 for the MoE SwiGLU output's traffic ->
1.034 for the up-projections' GEMMs, 2·(r_q·a·d_qk + r_kv·a·(d_qk − d_rope + d_v)) FLOPs per token and block at the
fp8 rate, and the rebuilt norms' traffic); the BF16 moments' smaller optimizer traffic moved it by +0.00005; no other
run moved. What is left, and why the run still does not fit by the model (77.3 GB of states and activations against
the 72 GB left by the planner's 10% reserve, an allowance, not a sourced figure): each stage's gradients on each of
its two ranks follow the DualPipe repository's example (deepseek-ai/DualPipe example_dualpipe.py: each of a rank's two
stages keeps its own .grad, summed after the step) where the paper names only the parameters (with the two stages'
gradients in one buffer the run would fit: 77.8 GB with the reserve); the optimizer states are not stated either and
are counted once per stage over its two ranks (half of each of a rank's two stages'; with both stages' whole states
on every rank, 88.4 GB). The per-rank layout is modelled since this pass (it was each stage's own weights and
gradients doubled and (PP+1)/PP of its micro-batches in flight: 86.7 GB, the middle 5-block stage paired with
itself); the verdict is unchanged, no ratio moved (the layout is memory only), and the assumed `split="ends"` (2
blocks on each end stage) leaves rank 0, which holds both ends with the embedding, the head and the MTP module,
lighter than the fullest ranks; the fp8 tiles' scaling factors (one per 128
elements, dtype not stated) are not counted; the final norm's output before the head (2·s·b·h on the last stage) is
still counted as stored.

![predicted / published vs GPU count]({rel_png})

The search's choice for each published job, by the model's own prediction (for a published configuration that the
memory model says does not fit, the comparison is with the fastest configuration regardless of memory, which shows
the published configuration is inside the search space and nothing in the space is mispriced below it):

{_table(("run", "published config step s", "fits", "search best step s", "search best", "published / best"), search_rows)}

Sources and assumptions:

{sources}

### Second pass against the sources

The three DeepSpeed-era misses of the first pass (GPT-NeoX-20B +18.7%, MT-NLG 530B on 2,800 and 3,360 GPUs +15.2%
and +19.6%, all over-predicted) were checked against the runs' published facts, looking for a modelling error or a
misread configuration. Nothing was fitted; two facts changed, both from the sources:

- **DeepSpeed's pipeline engine transfers serially** (model fix, all DeepSpeed runs):
  `deepspeed/runtime/pipe/schedule.py` (`TrainSchedule.steps`) puts two transfers in every schedule step of an interior stage
  (`SendGrad` + `RecvActivation` in a forward step, `RecvGrad` + `SendActivation` in a backward step), and
  `deepspeed/runtime/pipe/p2p.py` sends and receives with blocking `dist.send`/`dist.recv` (async "not supported").
  An interior stage therefore has 4·(m + p − 1) transfers on its timeline, where Megatron-LM batches the send and
  receive with a neighbour (2·(m + p − 1)). `PlannerOptions.pp_serial_p2p` prices this; the DeepSpeed runs set it
  (`tests/test_planner_published.py::test_deepspeed_pipeline_transfers_are_serial`). MT-NLG: 1.142, 1.152, 1.196
  → 1.099, 1.108, 1.151; BLOOM 1.023 → 0.968 (its stage messages cross 4 x 100 Gb/s Omni-Path shared by 8 GPUs).
- **GPT-NeoX-20B had no dropout** (recorded fact): the released configuration (EleutherAI/gpt-neox
  `configs/20B.yml`) sets `hidden-dropout` and `attention-dropout` to 0, and PyTorch's dropout with p = 0 returns its
  input (`aten/src/ATen/native/Dropout.cpp`, `_dropout_impl`), so no masks are kept and no dropout kernels run. The
  preset now says so; the prediction *rises* (1.169 → 1.277): the miss is larger, not smaller.

Checked and found as recorded (no change): MT-NLG — 105 layers, hidden 20480, 128 heads, sequence 2048, global batch
1920, TP 8 x PP 35, 60.1 / 50.2 / 44.4 s per iteration on 280 / 350 / 420 DGX A100 (80 GB, NVLink/NVSwitch, HDR
InfiniBand fat tree, Microsoft Research blog "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B");
the published TFLOP/s are Megatron's formula with recomputation, 96·B·s·l·h²·(1 + s/6h + V/16lh) / (t·GPUs) =
125.7, 120.4, 113.5, as the planner counts them. GPT-NeoX-20B — twelve Supermicro AS-4124GO-NART servers, eight
A100-SXM4-40GB each (NVLink, not PCIe), four ConnectX-6 HDR HCAs per node with GPUDirect RDMA (Black et al. 2022
§2.3); released config TP 2, PP 4, ZeRO-1, micro-batch 4 x 32 accumulation steps, full checkpointing, fp16, fused
softmax and bias-GeLU kernels (no FlashAttention, 2022), GPT-J parallel residual. BLOOM (BigScience
`train/tr11-176B-ml/tr11-176B-ml.slurm`): TP 4, PP 12, micro-batch 2, global batch 2048, sequence 2048, bf16 with
DeepSpeed ZeRO stage 0 whose bf16 optimizer "implements its own zero stage 1 equivalent", full checkpointing,
`--pp-partition-method 'type:transformer|embedding'` (the embedding weighs as a block at each end: split `ends`),
Megatron's default dropout 0.1 (no dropout flag). BLOOM's launch script sets
`CUDA_LAUNCH_BLOCKING=1` (BigScience `tr11-176B-ml.slurm`), an unpriced cost. The third pass (below) found how
GPT-NeoX counted its FLOPs.

### Third pass: the two remaining misses (figures before the fourth pass)

**GPT-NeoX-20B's 117 TFLOP/s is GPT-NeoX's own count, not Megatron's** (input fix). When the 20B model was trained
(early 2022) GPT-NeoX logged "approx flops per GPU" with `megatron/logging.py` `get_flops`:
`ff = model.total_params * 6; attn = seq_length * hidden_size * num_layers * 60;
flops = batch * seq_length * (ff + attn) / (iter_time * world_size)`, i.e. 6·Ψ + 60·s·h·l = 156.5 GFLOP per
token for the 20B model, with no recomputation factor. The planner's "tflops" is Megatron's count with
recomputation, 96·s·l·h²·(1 + s/6h + V/16lh) per sequence = 170.2 GFLOP per token, 8.7% more for the same step
time. The counter was replaced by Megatron-DeepSpeed's formula only in September 2023 (EleutherAI/gpt-neox issue
#981 "A question about flops calculation", PR #1044 "Improve FLOPS Calculation"; the later vocabulary-term slip is
issue #1093 / PR #1094, after the paper). `PublishedRun.flop_counter` now converts the prediction to the count a run
published (tokens/s/GPU x the counter's FLOPs per token; `FLOP_COUNTERS` in `planner/published.py`, test
`test_neox_tflops_are_counted_as_gpt_neox_counts_them`), never the published figure. Also from the sources:
DeepSpeed's fp16 engine accumulates gradients in the fp16 `.grad` and ZeRO-1 reduces them in fp16 (no fp32
buffer: `grad_accum_fp32=False` for this run). GPT-NeoX-20B: 1.277 → 1.178.

What is left of the NeoX miss (+18%) has no sourced mechanism. Checked: the hardware inputs (A100-SXM4-40GB at
1.555 TB/s HBM2 in the preset, NVSwitch, four HDR HCAs per eight GPUs, each stage spanning three nodes);
DeepSpeed's schedule, simulated event by event from `TrainSchedule` with rendezvous (blocking) transfers: on
uniform stages the simulated step equals (m + p − 1)·(t_f + t_b) + 4·(m + p − 1)·t_send, the planner's formula,
and with a heavier last stage part of the transfers hides in the other stages' slack, so the planner is the more
pessimistic (by 3.5% of the step for MT-NLG's shape): the schedule hides no cost
(`tests/test_planner_deepspeed_schedule.py`); `synchronize-each-layer` (~1,000 device synchronisations per step, each idling the device for the
launch latency of the next layer, under 1% of a 48 s step); GPT-J's parallel residual halves the forward TP
all-reduces, which the planner does not credit (it would raise the prediction by 0.8%). The likely remainder is
the sustained matmul efficiency of the 2022 stack (PyTorch 1.10, CUDA 11.1, fp16 on 40 GB parts), which the two
constants fitted on Megatron-LM's 2021 runs do not carry over to; no published measurement pins it, so the run
stays a miss.

**MT-NLG 530B on 3,360 GPUs (+15.1%)**: the gap between the published and the predicted step is nearly constant in
seconds across the sweep (60.1 − 54.6 = 5.5 s, 50.2 − 45.1 = 5.1 s, 44.4 − 38.7 = 5.7 s on 2,240 / 2,800 / 3,360
GPUs) while the micro-batches per step fall from 240 to 160: a per-step cost of about 5.5 s that does not scale with
m, close to the whole modelled 1F1B bubble (6.0 s). Checked and priced or negligible: the schedule (simulation as
above), the tied embedding's gradient all-reduce between the first and the last stage (262 MB, ~12 ms), the loss
broadcast over 35 stages (latency only), ZeRO-1's reduction and parameter all-gather (priced). The paper does not
state the micro-batch size: with 2 sequences per micro-batch the bubble doubles and the three rows would land at
0.985, 0.972 and 0.989, which would also reproduce the fall from 126 to 113 TFLOP/s, but micro-batch 1 was fixed as
the assumption before looking at the predictions and changing it on this evidence alone would be fitting on the
validation runs. It stays at 1 and the 3,360-GPU row stays 0.1% outside the target.

### Fourth pass: DeepSpeed's stage messages, and what was searched for the misses

**DeepSpeed partitions its stage-to-stage messages over the tensor-parallel group** (input fix, the three
DeepSpeed runs). The earlier passes priced DeepSpeed's pipeline sends as whole activations; the engine's code says
otherwise. `deepspeed/runtime/pipe/engine.py` (`PipelineEngine.__init__`: `is_pipe_partitioned =
self.is_model_parallel`, `is_grad_partitioned = self.is_model_parallel`; the same lines in EleutherAI/DeeperSpeed,
the fork GPT-NeoX-20B trained with; DeepSpeed's first pipeline engine already partitioned the activations) wraps the first output of a
stage in a `PartitionedTensor` over the slice-parallel (TP) group before `_exec_send_activations`, sends each rank's
1/tp part, and re-assembles it on arrival with `PartitionedTensor.full()` (an all-gather over the TP group); the
gradient sent back is partitioned the same way. Later DeepSpeed keeps it as the defaults of the `pipeline` config
(`get_pipeline_config`: `"pipe_partitioned": True, "grad_partitioned": True`). That is Megatron-LM's scatter/gather:
MT-NLG's messages are 2048·20480·2 / 8 = 10.5 MB per rank, not 84 MB. The DeepSpeed runs now set
`pp_scatter_gather=True` (`test_deepspeed_pipeline_messages_are_partitioned_over_the_tp_group`: by hand, the network
time saved is 4·(240 + 34) transfers x 7/8 of 84 MB over a 200 Gb/s rail at 90%). The fix moves every DeepSpeed row
*away* from its published figure, and it stays because the source says so: MT-NLG 1.099, 1.108, 1.151 → 1.176,
1.186, 1.232; GPT-NeoX-20B 1.178 → 1.199; BLOOM 0.968 → 1.052. Dense runs within 15%: 10 → 8 of 12. Not priced, both
small: the all-gather on arrival over NVLink (for Megatron-LM's gather too; ~0.3 ms per 84 MB message on eight A100s,
2·(m + p − 1) per step, about 0.2 s of MT-NLG's 51 s step), and the attention mask GPT-NeoX's pipeline carries with
every activation (DeeperSpeed's `has_attention_mask` for `GPT2ModelPipe`, a 2048 x 2048 mask cast to fp16, 8 MB,
about 25 ms per step).

**GPT-J's parallel residual is priced** (mechanism, any model with parallel blocks). GPT-NeoX-20B trains with
`gpt_j_residual: true` (`configs/20B.yml`): `ParallelTransformerLayer` builds the attention and MLP output layers with
`parallel_output` (no all-reduce each) and all-reduces their sum once (`reduce_from_model_parallel_region`), while
the backward still all-reduces the gradient of each branch's column-parallel input. `ModelSpec.parallel_block`
(set for the `gpt-neox-20b` preset) prices 1 forward all-reduce per block instead of 2, so 4 instead of 6 per block
and micro-batch with full recompute (`tests/test_planner_formulas.py::test_parallel_block_has_one_forward_all_reduce`,
by hand on a two-way TP toy config, with sequence parallelism as the unchanged control). Like the message fix it
raises the prediction: GPT-NeoX-20B 1.199 → 1.210.

**MT-NLG 530B**: with the messages partitioned the gap to the published step is still nearly constant in seconds
(60.1 − 51.0 = 9.1 s, 50.2 − 42.1 = 8.1 s, 44.4 − 36.2 = 8.2 s) while m falls from 240 to 160, i.e. a per-step cost
the model does not have, larger than the whole modelled 1F1B bubble (6.0 s). Searched for the micro-batch size, the
one input that would scale the bubble: the paper's full text is not in the stored material (only abstracts and
third-party summaries: TP 8 x PP 35, global batch 1920 ramped from 32, sequence 2048, bf16 mixed precision, 8 HDR
HCAs per DGX A100); Microsoft/Megatron-DeepSpeed's examples, DeepSpeed's "Training your large model" page and
DeepSpeed/Megatron-DeepSpeed issues state no MT-NLG micro-batch. The one script found for the same shape, NVIDIA's
Megatron-LM `gpt3-530b` job for Selene (TP 8, PP 35, 105 layers, hidden 20480; a Megatron-LM benchmark with global
batch 192, not MT-NLG's DeepSpeed run), uses `--micro-batch-size 1`, consistent with the assumption. With 2
sequences per micro-batch the three rows would be 1.055, 1.041, 1.059; not adopted (no source). Nor is the remainder
a per-micro-batch cost of DeepSpeed's pipeline engine that its authors' own measurement would show: "training with
gradient accumulation steps ... 4x or 8x the number of pipeline stages achieves 81% and 90% scaling efficiency from
one pipeline stage" (Microsoft Research blog "DeepSpeed: Extreme-scale model training for everyone", 2020), where the
1F1B bound m/(m + p − 1) is 82% and 90% at p = 8 (80% and 89% for large p): the engine ran at its bubble.

**GPT-NeoX-20B**: is 117 TFLOP/s the sustained figure? A compiled summary of the paper (nl2code.github.io, "training
time: 1,830 hours"; the paper itself was not in the stored material) gives 150,000 steps in 1,830 h = 43.9 s per
step, which is 116.8 TFLOP/s by GPT-NeoX's counter: the published figure is the whole run's average (or was derived
from it), so it includes what a step-time model leaves out — checkpoints every 500 steps (optimizer states included;
no filesystem figure found), 10 evaluation iterations every 1,000 steps (forward only, ~0.25%), restarts. A second
measurement of the same stack on the same GPU: Pythia 12B (Biderman et al. 2023, App. D Table 5, as a public dataset of
training runs quotes it; GPU hours from logged iteration times: 72,300 on 256 A100-40GB for 299.9B tokens = 1,152 tokens/s/GPU = 108 TFLOP/s by the same
counter), a different configuration (model shape, parallel layout, kernels), so it is not priced here; it shows the stack's level,
not a mechanism. The released `configs/20B.yml` (EleutherAI/gpt-neox) was re-read: nothing in it is priced
differently from the table (TP 2, PP 4, ZeRO-1 with 1.26e9 buckets, micro-batch 4 x 32, full checkpointing without
partitioned activations, `synchronize-each-layer`, fp16 with dynamic loss scale, untied output layer, no dropout).
No published A100-40GB GEMM efficiency for that stack (PyTorch 1.10, CUDA 11.1) was found; the calibration's
Megatron-LM runs are of the same CUDA 11 generation. Both runs stay misses, now +21% and +18% to +23%.

### Fifth pass: the memory of the two runs the model called infeasible

A run that ran fits in its GPUs' memory, so a NO for a published configuration is either a memory term counted
that the framework does not keep, or a wrong assumption about the configuration. Both rows were compared term by
term with their sources; nothing was tuned (the reserve in particular was left as it is).

**GPT 1T (Korthikanti et al.)**: its first stage (2 of the 128 blocks and the embedding) per GPU, against the paper's
formulas (Table 2, §4.2.3, §4.3) and Megatron-LM's own implementation of them
(`megatron/training/theoretical_memory_usage.py`: 18 bytes per parameter without the distributed optimizer, 34·s·b·h/t
per block for L blocks, the embedding dropout's s·b·h·p/t, x (1 + (p − 1)/(p·v)) when interleaved):

| term | Korthikanti / Megatron-LM | before (v = 2) | after (not interleaved) |
|---|---|---|---|
| weights 2 + fp32 main_grad 4 + fp32 master, Adam m, v 12 B/param, 2.183 B params | 39.29 GB | 39.29 | 39.29 |
| blocks: 34·s·b·h/t x 128 (x 1.492 if v = 2) | 28.52 GB (42.56 with v = 2) | 42.56 | 28.52 |
| embedding dropout mask s·b·h·p/t (x 1.492 if v = 2) | 0.42 GB (0.63) | not counted | 0.42 |
| one block's attention scores rebuilt in its backward (selective) | a transient the paper leaves out | 0.42 | 0.42 |
| reserve (10%) | none | 8.00 | 8.00 |
| total | 68.23 GB (82.47 with v = 2) | 90.27, NO | 76.65, fits |

The model did not over-count: its per-block and state terms are the paper's; it lacked §4.3's terms outside the
blocks (the embedding's mask on the first stage, and on the head's stage the final norm's and the output
projection's inputs 4·s·b·h/t beside the fp32 logits), which are now counted (`memory.embedding_dropout_bytes`,
`memory.head_input_bytes`; tests `test_first_stage_activations_follow_korthikanti_section_4_3`,
`test_head_stage_keeps_norm_and_projection_inputs_and_logits`; BLOOM, OPT and the MT-NLG rows gain 0.7 to 1.5 GB, no
row changes its verdict or ratio). What made the row infeasible was the assumed interleaving: by the paper's own
formula an interleaved (v = 2) 1T stage needs 82.47 GB with no reserve at all, more than the A100's 80 GB. The paper
says which runs were interleaved (§6: "We use the interleaving schedule with three interleaving stages (m = 3) for
the 175B and 530B models"), and its Table 3 gives the micro-batch sizes (22B: 4, the others 1). The four rows now
take these (`test_korthikanti_runs_as_the_paper_states_them`, `test_gpt_1t_first_stage_by_korthikanti`), and the
ratios move: 22B 0.999 → 1.037 (micro-batch 4, one micro-batch per step), 175B 0.963 → 0.977 (v 2 → 3), 1T 0.923 →
0.883 (not interleaved: a bubble of 63/512 instead of 63/1024); 530B unchanged (v = 3 already). The reserve of 10% is
an allowance with no source (no measurement of the CUDA context, NCCL buffers and fragmentation for these runs was
found); neither verdict depends on it (the 1T row fits with or without it, and without it the interleaved
configuration still does not).

**LLaMA 3 405B** (8,192 and 16,384 GPUs): the fullest stage is a middle one (8 blocks; the first and the last hold 7):
bf16 weights 6.38 GB, the fp32 gradient buffer 12.75 GB, optimizer states 0.60 GB (0.30 at DP 128), and before this
pass activations of 93.75 GB = 8 blocks x 0.533 GB (31.75·s·b·h/t for a SwiGLU block with GQA and FlashAttention, s = 8192) x 22
micro-batches in flight (15 x (1 + 14/30), the second stage's count under Megatron-LM's interleaved schedule with
v = 2). What the paper states (Dubey et al. 2024 §3.3.2): "we could pre-train Llama 3 on sequences of 8K tokens
without activation checkpointing", so no recomputation is the paper's, not an assumption; FSDP "shards optimizer
states and gradients, but for model shards we do not reshard after forward computation", with fp32 gradient
accumulation over micro-batches: the rows now say ZeRO-2 (with 32 or 16 micro-batches the full fp32 buffer is kept,
as under ZeRO-1: memory and ratios unchanged). The 94 GB comes from the assumed v = 2 (plain 1F1B: 63.9 GB), and the
paper contradicts it: "we reduce one Transformer layer each from the first and the last stages ... This means that
the first model chunk on the first stage has only the embedding" — removing one block empties the first chunk only if
a chunk holds one block, i.e. 126 + 2 = 16 x 8 chunks, V = 8. It does not rescue the row: with V = 8 and Megatron's
count (N = PP contiguous micro-batches) the stage keeps 15 x (1 + 14/120) = 16.75 micro-batches, 71.4 GB, and even
plain 1F1B needs 83.6 GB without any reserve. Meta's schedule makes N tunable and was changed because "the first
stage consumes more memory due to the embedding and the warm-up micro-batches", and it deallocates the stages' input
and output tensors; the paper gives neither N nor a memory figure, so the in-flight count of the schedule that ran is
unknown and the row stays NOT fitting (99.1 and 98.8 GB with the reserve, was 121.5 and 121.2;
`test_llama3_rows_as_section_3_3_2_states_them`). V = 8 is priced: the `ends` split now lets the first stage's first
chunk hold only the embedding and the last stage's last chunk only the head (`stages.edge_chunk_allowance`, used by
`split_problem` and the search's `vpp_choices`; test
`test_ends_split_lets_the_end_chunks_hold_only_the_embedding_and_the_head`), and the bubble is the paper's own
(PP − 1)/(V·M). Ratios: 8,192 GPUs 1.000 → 1.128, 16,384 GPUs 0.870 → 1.098 (the paper's drop from 43% to 41% MFU
is now predicted as 48.5% to 45.0%, where v = 2 gave 43.0% to 35.7%). Over the dense runs the drift with scale
rises from +0.0025 to +0.0080 per doubling and the mean ratio of the runs on 2,048 GPUs or more from 1.055 to 1.085
(`test_no_drift_with_scale`: 0.01 and 0.10, still met): the v = 2 assumption had hidden part of the over-prediction at
scale (MT-NLG's DeepSpeed rows, +18% to +23%) by under-pricing the 16,384-GPU row.

Recalled figures, second look (the fifth pass then read Korthikanti et al.'s full text, and Table 5 is as recalled
here): Korthikanti et al.'s Table 5 could not be consulted in full text at that time; its iteration times
and MFU (22B 1.10 s / 41.5%, 175B 13.75 s / 51.4%, 530B 37.83 s / 56.0%, 1T 71.49 s / 56.3%) are consistent with
each other under the paper's MFU definition (72·B·s·l·h²·(1 + s/6h + V/12lh) / (t·GPUs·312 TFLOP/s) gives 41.65%,
51.39%, 56.05%, 56.27%), and the abstract (MLSys 2023 proceedings page) confirms the method's headline, 54.2% against
42.1% MFU for the 530B model on 2,240 GPUs, a different configuration from the 280-GPU row used here. DeepSeek-V3:
180K H800 GPU hours per trillion tokens and 14.8T tokens in 2.664M GPU hours agree (1,543 tokens/s/GPU). Dense peaks
as the presets have them: H100/H200 SXM 989 (bf16) and 1,979 (fp8) TFLOP/s, H200 141 GB and 900 GB/s NVLink
(MLCommons system descriptions), B200 (HGX, 1,000 W) 2,250 and 4,500, MI300X 1,307 and 2,615 with 192 GB at
5.3 TB/s; these came from vendor-derived third-party tables, the vendors' datasheets themselves were not retrieved.
"""


def _hardware_table():
    rows = []
    cite = {"A100-40GB": "NVIDIA A100 datasheet (2021)", "A100-80GB": "NVIDIA A100 datasheet (2021)",
            "H100-80GB": "NVIDIA H100 SXM datasheet (2023)", "H100-SXM": "NVIDIA H100 SXM datasheet (2023)",
            "H800": "NVIDIA H800 SXM (H100 with 400 GB/s NVLink), DeepSeek-V3 report §3.1",
            "H200": "NVIDIA H200 SXM datasheet (2024)", "B200": "NVIDIA DGX B200 datasheet (2024), per GPU",
            "MI300X": "AMD Instinct MI300X datasheet (2023)"}
    for name, dev in DEVICES.items():
        peak = dict(dev.peak_flops)
        intra, fabric = _LINKS[name]
        rows.append((name, f"{peak['bfloat16'] / 1e12:.0f}", f"{peak.get('float8', 0) / 1e12:.0f}" if 'float8' in peak
                     else "-", f"{dev.memory_bytes / 1e9:.0f}", f"{dev.memory_bandwidth_Bps / 1e12:.2f}",
                     f"{2 * intra.bandwidth_Bps / 1e9:.0f}", f"{fabric.nics_per_node} x {fabric.nic_bandwidth_Bps * 8 / 1e9:.0f} Gb/s",
                     f"{fabric.host_memory_bytes / 1e12:.1f}", cite[name]))
    return _table(("device", "bf16 TFLOP/s", "fp8 TFLOP/s", "HBM GB", "HBM TB/s", "NVLink GB/s (bidir.)",
                   "NICs per node", "host TB per node", "source"), rows)


def model_md(opts):
    return f"""## Cost model

### Step time on the slowest stage

`step = m·t_max + bubble + pipeline sends + exposed overlappable communication + parameter gathers + optimizer`.
A block costs `T_L = 3·t_fwd + t_recompute + TP collectives (+ expert all-to-all)` (TP all-reduces: 2 forward,
2 backward, 2 more with full recompute; a parallel attention + MLP block, `ModelSpec.parallel_block` as GPT-J and
GPT-NeoX, has 1 forward), a block's forward
`t_fwd = matmul FLOPs / (peak·gemm_efficiency) + activation_traffic_factor·activation bytes / HBM bandwidth`;
stage i costs `n_i·T_L` (+ the output head, 3·t_logits, on the last stage). The slowest stage sets the pace
(`t_max`); the others fill and drain the pipeline once: `bubble = (Σ_i t_i − t_max) / v`, which is
`(p−1)/v·t` for equal stages. Each stage's overlapped communication (ZeRO-3 gathers, the gradient sync, overlapped
all-to-alls) is set against that stage's own compute windows, and the step follows the stage whose compute plus
exposed communication is largest (the first, the last with the head and any multi-token-prediction modules, or the
fullest middle stage). Stage splits (`planner/stages.py`): `even` (surplus blocks to the middle stages),
`ends` (first and last stage one block lighter, as LLaMA 3 405B's 7, 8 x 14, 7), `balanced` (the head priced as
2hV/(2P_mm + 4sh) blocks, with any multi-token-prediction modules, the split minimising the slowest stage).
Interleaving needs every stage to hold at least v blocks (under `ends` the first and the last stage v − 1: their
end chunk holds only the embedding or the head, as in LLaMA 3's schedule, Dubey et al. 2024 §3.3.2) and the search
offers the v dividing the largest stage, so layers need not divide by p·v (126 blocks on 16 stages: v = 2, 4, and 8
under `ends`). A split that leaves a stage or another virtual stage empty is a ValueError naming it.

### One link, one budget (`planner/links.py`)

Every stream is placed on the links it uses: TP and pipeline sends and expert all-to-alls are on the critical
path; ZeRO-3 gathers (forward, backward), the gradient reduce-scatters of ZeRO-2/3 paid per micro-batch, and the
gradient sync of the accumulated buffer are overlappable. Per link (NVLink, network):

`exposed_L = max(0, fwd_L − o·W_fwd) + max(0, bwd_L + sync_L − o·W_bwd, sync_L − o·W_last)`

with `W` the step's forward and backward compute (counted once for all the streams of that link), `W_last` the
last micro-batch's backward (where the sync of an accumulated buffer starts), `o = cluster.overlap`. The step pays
`max_L exposed_L` (links work in parallel), so a link's total traffic (critical + overlapped) never exceeds its
bandwidth x the step time: `tests/test_planner_fidelity.py` checks `link_busy_s <= step` for every configuration of
three searches. ZeRO-1/2 re-gather the updated parameters after the optimizer step (exposed, as the runtime and
DeepSpeed do); offload traffic runs on PCIe (`link_busy_s["pcie"]`).

### ZeRO-2/3 gradients with m micro-batches, as the runtime does it

`parallel/reducer.py` launches nothing on non-final accumulation micro-steps: the full gradient accumulates
locally (fp32) and is reduce-scattered once, at the last micro-batch. So the planner's ZeRO-2/3 with m > 1 holds
the full gradient buffer (ZeRO-1's gradient memory) and pays one reduce-scatter per step;
`PlannerOptions(zero_grad_per_micro_batch=True)` prices the other choice (m reduce-scatters, only the shard held).
`test_runtime_zero2_accumulates_the_full_gradient_and_reduce_scatters_once` runs the runtime (simulated, 2 ranks,
ZeRO-2, 2 micro-batches) and checks both facts against the planner.

### Collectives at scale (`comm/cost.py: hierarchical_seconds`, `planner/topology.py`)

A group of n ranks `stride` apart has g members per node on k nodes. NCCL's rings pass through every rank:
the ring volume (`collective_bytes`: `2(n−1)/n·b` for an all-reduce) crosses each node's NICs once, shared by the
node's g ranks on their own NIC rails, and its other hops are NVLink, so NVLink carries `ring·(g−1)/g` and the
network `ring/g` per rank; the two links work as a pipeline (NCCL channels), so a call takes its latency plus the
busier link. Latency grows with the group: a ring pays `(g−1)` NVLink and `(k−1)` network steps per phase,
NCCL's tree all-reduce `2·ceil(log2 k)` network steps (the cheaper is taken, which is NCCL's tuner's choice for
latency-bound sizes). `ClusterSpec.topology` gives GPUs and NICs per node, NIC speed, rail-optimised or not
(all-to-all on rails first crosses NVLink: PXN), nodes per leaf and oversubscription (bandwidth divided beyond a
leaf), host RAM and PCIe per node.

Describing a cluster:

<!-- snippet: run -->
```python
import autoparallel as ap
from autoparallel.planner.cluster import cluster_of
from autoparallel.planner.topology import Topology
fabric = Topology(nics_per_node=8, nic_bandwidth_Bps=50e9, rail_optimized=True, nodes_per_leaf=32,
                  oversubscription=2.0, host_memory_bytes=2e12, pcie_bandwidth_Bps=25e9)
cluster = cluster_of("H100-80GB", 1024, fabric)          # 128 nodes of 8; 1020 GPUs would be a ValueError
ap.plan("llama2-70b", cluster, global_batch_size=1536, seq_len=4096)
```

Anchors (NCCL bus bandwidth: nccl-tests' `busbw` = algorithm bandwidth x 2(n−1)/n for an all-reduce and
(n−1)/n for reduce-scatter / all-gather, "the speed of the hardware bottleneck: NVLink, PCI, QPI, or network",
NVIDIA/nccl-tests `doc/PERFORMANCE.md`), from NVIDIA's NCCL maintainers:
- intra-node: "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an effective NVLink
  bandwidth of 370GB/s" on H100, and with NVLink SHARP "on 8 GPUs ... a peak busBw of ~480GB/s" (NVIDIA/nccl-tests
  issue 212, S. Jeaugey); on 8 A100 "you should be seeing close to 240 GB/s" of the 300 GB/s per direction
  (NVIDIA/nccl issue 1712, NVIDIA); on A800 (200 GB/s per direction) "~160GB/s intra-node" (NVIDIA/nccl issue
  412). Hence `nvlink_efficiency` = 0.8 (our algorithms do not use NVLS).
- inter-node: "24GB/s inter-node" on one HDR 200 Gb/s NIC (25 GB/s line rate) with GPUDirect RDMA (NVIDIA/nccl
  issue 412), i.e. 96% of line rate in a large-message test of an idle fabric; on two nodes NCCL uses the tree (or
  NVLSTree) algorithm, whose bus bandwidth can exceed the network's, so ring bandwidth is measured with
  `NCCL_ALGO=RING` (NVIDIA/nccl-tests issue 196). The ring's bus bandwidth is the node's NIC bandwidth; the model
  reproduces it exactly (`test_hierarchical_all_reduce_by_hand`: 2(n−1)/n·b / t_network = NICs x NIC speed x
  efficiency), with `network_efficiency` = 0.9 of line rate, below NVIDIA's idle-fabric 96% (an allowance for
  a training job's concurrent traffic that no source states; at 0.96 the validation ratios move by at most 0.004).

A topology whose GPUs per node differ from the cluster's, or a device count that does not fill whole nodes
(`cluster_of`), is a ValueError naming both numbers.

### Memory

Per device on the stage that needs most (first: p micro-batches in flight; last: the fp32 logits; the fullest
middle stage): bf16 weights 2 B/param, the fp32 gradient accumulation buffer 4 B/param (Megatron's main_grad,
DeepSpeed's bf16 optimizer and this runtime's AMP all keep it; `grad_accum_fp32`), fp32 master + Adam m, v
12 B/param, divided by ZeRO stage (ZeRO-2/3 gradients only when they really are sharded, above), routed experts
over `ep·tp` and their states over `dp/ep`; activations per Korthikanti et al. (Table 2 per block; the first stage
keeps p micro-batches, x (1 + (p − 1)/(p·v)) interleaved, §4.2.3; §4.3's terms outside the blocks: the embedding
dropout's mask s·b·h/t per micro-batch in flight on the first stage, and on the head's stage the final norm's and the
output projection's inputs 4·s·b·h/t and the fp32 logits 4·s·b·V/t; the mask and the inputs are not divided by t
where sequence parallelism is off), plus one block's rebuilt activations while it runs backward under recompute;
the ZeRO-3 gather buffer; a
reserve of {100 * opts.memory_reserve_fraction:.0f}% of device memory as headroom for the CUDA context, NCCL buffers
and allocator fragmentation — an allowance, not a sourced figure (no dense run's verdict depends on it, "Fifth
pass"; DeepSeek-V3's does: 78.7 GB before it, "Validation"). Host RAM per node is a constraint when offloading: the node's devices'
optimizer states and pinned fp32 gradient chunks (16 B per offloaded parameter) must fit in
{100 * (1 - opts.host_memory_reserve_fraction):.0f}% of the node's RAM (the rest for the OS, data loaders and
staging buffers).

Per-run storage choices (DeepSeek-AI 2024, arXiv:2412.19437; `PlannerOptions`, off by default; 16-bit runs only, a
ValueError otherwise): `linear_input_bytes` (§3.3.3 "cache activations in FP8 format for the backward pass of the
Linear operator": 1 B per element for every Linear's cached input: the QKV and MLP inputs, MLA's up-projection
inputs, the MLP's last matmul's input, the dispatched token copies), `attention_output_bytes` (the inputs of the
Linear after attention, "a customized E5M6 data format": 12 bits, 1.5 B), `moe_swiglu_recompute` (MoE blocks keep
only the SwiGLU's inputs, at `linear_input_bytes`, §3.3.3 (2)), `recompute_norm_up_projection` (§3.2.3: the norms'
outputs and MLA's Q, K, V are not stored; one block's worth is rebuilt in backward, counted with the recompute working
set, and its time priced: the up-projections' GEMMs at the linear layers' rate plus the rebuilt tensors' traffic),
`optimizer_moment_bytes` (§3.3.3: BF16 moments, 4 + 2 + 2 = 8 B/param of optimizer state; master weights and
gradients stay fp32). DualPipe's memory comes with its schedule (`ParallelConfig.dualpipe`, "DualPipe" below; it was
the option `dualpipe_memory`, now removed so that schedule and memory cannot disagree): §3.2.1 Table 2 and the DualPipe repository's
example: rank r holds stages r and PP−1−r (every stage's weights and gradients on two ranks), keeps stage r's
activations for PP − r micro-batches and stage PP−1−r's for r + 1 (PP + 1 in all), and half of each stage's optimizer
states (`stage_memory.device_rows`; the device that needs most is the fullest rank).
Norm inputs, the attention core's inputs and the activation function's inputs stay 16-bit (the paper keeps
normalization and attention operators in BF16/FP32, §3.3.1).

### Mixture of experts

`ModelSpec(experts, top_k, expert_ffn, shared_experts, dense_layers, route_nodes)`: per block (averaged over the
dense and MoE blocks) the attention, dense MLP, shared experts and router are TP-split, the routed experts are
split over `ep·tp`; a token's FLOPs count its top_k experts. The expert-parallel degree `ep` (divisors of dp and of
the expert count) is a search dimension. Dispatch and combine are all-to-alls over the EP group (4 per MoE block and
micro-batch, 6 with full recompute), on the critical path, or overlapped with compute under the link budget
(`moe_a2a_overlap`, DeepSeek's DualPipe); node-limited routing sends a token over the network at most once per
remote node. Expert compute runs at the busiest rank's pace (`moe_imbalance` = {opts.moe_imbalance}). Bad input
(top_k > experts, expert fields without experts) is a ValueError. The runtime runs experts replicated, so a plan
with ep > 1 is priced but `to_strategy_dict` raises NotImplementedError. The first `dense_layers` blocks keep the
dense MLP; every per-block figure is the average over dense and MoE blocks (DeepSeek-V3: 3 dense blocks of FFN
18,432 = 9 x 2,048, the width a token visits in an MoE block with top-8 + 1 shared expert, so FLOPs per block agree
within 0.3%; a stage of MoE blocks only holds 61/58 of the averaged routed experts and all-to-alls). With the
storage options ("Memory") the MoE blocks' SwiGLU inputs and the dispatched token copies are counted at their cached
width (DeepSeek-V3: FP8, the dispatch quantized before the all-to-all, §3.3.3), the dense blocks' MLP as before.

Multi-head latent attention (DeepSeek-AI 2024, arXiv:2412.19437 §2.1.1; `ModelSpec(qk_head_dim, v_head_dim,
q_lora_rank, kv_lora_rank, qk_rope_head_dim)`, read from a config that sets `kv_lora_rank`, the DeepSeek-V2/V3
names): the hidden state is projected down to a query latent (h x r_q) and a key/value latent plus the shared rope
key (h x (r_kv + d_rope)), both replicated under TP as the runtime's MLA plan keeps them (split only by SP), normed,
and projected up per head (r_q x a·d_qk, r_kv x a·(d_qk - d_rope + d_v)) and out (a·d_v x h), split with the
heads. The attention core is `2·s·a·(d_qk + d_v)` FLOPs per token (`4·s·h` for heads of h/a); the block keeps Q and
K of a·d_qk, V and the attention output of a·d_v (split by TP) and both latents twice (their norms' and
up-projections' inputs). DeepSeek-V3 (config.json: 128 heads, r_q 1,536, r_kv 512, d_qk 128 + 64, d_v 128):
187.1M attention parameters per block (multi-head attention of width 7,168 had 205.5M), 671.0B parameters in all,
an attention core of 2·s·128·320 instead of 4·s·7,168 FLOPs per token.

Multi-token prediction (§2.2; `ModelSpec.mtp_depth`, planner/mtp.py; DeepSeek-V3 D = 1, `num_nextn_predict_layers`
1): each module, on the last stage next to the output head it shares, adds one block (an MoE block), the 2h -> h
projection of the two normed inputs and a second output-head pass with its cross-entropy: time (and the windows
that overlapped communication hides in), the split's head weight, parameters (11.6B for DeepSeek-V3, the paper's
"14B" counts the shared embedding and head again) and activations (the block's, the second fp32 logits, the
inputs). The step follows the stage whose compute plus exposed overlapped communication is largest, each stage's
all-to-alls against its own compute windows.

### Hardware presets

{_hardware_table()}

fp8 is a precision of the planner (`PlannerOptions(precision="fp8")`): the linear layers' matmuls (forward and
both backward GEMMs) at the fp8 peak, the attention core (scores and context), the MoE router and the output head at
the bf16 peak (`PlannerOptions.core_dtype`), as DeepSeek-V3's mixed-precision framework keeps "the embedding module,
the output head, MoE gating modules, normalization operators, and attention operators" in BF16/FP32 (arXiv:2412.19437
§3.3.1); storage as bf16. It is planner-only (the runtime's AMP has float16 and bfloat16) and the plan's explanation
says so.

### DualPipe

DeepSeek's bidirectional schedule (DeepSeek-AI 2024, arXiv:2412.19437 §3.2.1 and Table 2; deepseek-ai/DualPipe) is a
schedule of the planner: `ParallelConfig.dualpipe` = 1 (`--fixed ...,dualpipe=1`, the constraint `dualpipe=[0, 1]`),
priced in planner/dualpipe.py and the cost model:

- Validity: "DualPipe only requires that the pipeline stages and micro-batches be divisible by 2" (§3.2.1), and the
  repository's `step` asserts at least 2·PP micro-batches; the schedule has no virtual stages. Odd pp or an odd
  micro-batch count, fewer than 2·pp micro-batches, vpp > 1 or pp = 1 with DualPipe are a ValueError naming them.
- Bubble (Table 2): (PP/2 − 1)(F&B + B − 3W) (none at PP = 2, as the formula gives) against 1F1B's (PP − 1)(F + B)
  (ZB1P's (PP − 1)(F + B − 2W) is written
  out for comparison, not a schedule of the search). F is a device's forward chunk per micro-batch (its blocks'
  forward and the forward's TP collectives and exposed all-to-alls), B the rest of its work (the full backward with
  recomputation), W the weight-gradient GEMMs: a layer with weights computes a data gradient and a weight gradient in
  backward, each a GEMM of its forward's FLOPs, so W is the linear layers' (and the router's, the output head's, the
  MTP module's) forward GEMM time; the attention core, norms and activations have no W (`weight_grad_seconds`).
- F&B, "two mutually overlapped forward and backward chunks", is priced as F + B, no less than the all-to-all the
  pair overlaps on its busiest link: interleaving two chunks' compute on one device does not make it faster (§3.2.1
  dedicates SMs to communication), what the overlap hides is the communication.
- The slowest device: rank r holds stages r and PP−1−r (deepseek-ai/DualPipe example_dualpipe.py) and runs half the
  micro-batches through each, so its work per micro-batch is the mean of its two stages'; with equal stages that
  is 1F1B's, and only the bubble differs. Rank 0 holds both ends (the embedding, the output head and the MTP module):
  under the DeepSeek-V3 row's assumed `ends` split (2 blocks on each end stage; 2, 4, 5, 4 x 11, 2 for 61 blocks)
  rank 0 runs 2 blocks and half the head per micro-batch and the pace is set by ranks 2 and 13 (the 5-block stage
  with a 4-block one, 4.5 blocks per micro-batch), where 1F1B was paced by the last stage (2 blocks, two bf16
  output-head passes and the MTP block). The bubble is the slowest device's.
- Memory: per rank, stages r and PP−1−r with PP − r and r + 1 micro-batches in flight ("Memory").
- Data parallelism: every stage lives on 2·dp ranks (dp replicas of its two copies), so a rank's gradients, ZeRO
  shards and optimizer step cover its two stages: the gradients are summed over the dp group and then, their 1/dp
  part, with the partner rank (deepseek-ai/DualPipe example_dualpipe.py sums the two copies' gradients after the step;
  the partner priced half the world away), ZeRO gathers likewise, and ZeRO shards over 2·dp (memory the same way).
  DeepSeek-V3: data-parallel time 0.48 -> 0.67 s, step 15.48 -> 15.67 s, ratio 1.286 -> 1.271; no other run moved.
  The search's best plan that fits for that job is then an interleaved 1F1B one (dp 256, tp 2, pp 4, vpp 4:
  15.54 s; 15.85 s with FP8's quantization passes below), faster than the published one by the model.
- Pipeline sends are priced as 1F1B's; the steady state's overlapped all-to-all is budgeted as for 1F1B (forward
  traffic against forward compute, backward against backward), although DualPipe overlaps a forward chunk's
  all-to-all with another micro-batch's backward.

The runtime cannot run DualPipe: a plan that uses it is planner-only, the explanation says so (as for fp8), and
`to_strategy_dict` (so `auto_mode="full"`) raises NotImplementedError rather than running 1F1B. Like fp8, which the
search never picks by itself, DualPipe is searched only when the constraints allow it (`SearchSpace.dualpipe`
defaults to (0,)), so a default plan stays runnable; a calibrated CPU profile (the eager runtime's costs) never
prices it (a fixed DualPipe plan there is a NotImplementedError, its search leaves DualPipe out). A published run
that used DualPipe (DeepSeek-V3) is compared with a search that may use it too (`published.search_best`), so the
search is measured against the run's own schedule. DeepSeek-V3's ratio moved 1.034 -> 1.402 (step 19.25 s -> 14.20
s): 1.337 from the pairing of stages on a rank alone (with a (PP − 1)·F&B bubble), the rest from Table 2's bubble
(1.31 s -> 0.81 s); no other run moved. Weight of two assumptions (shown only for that; none adopted): under DualPipe
the row's split moves the ratio to 1.295 (`even`: rank 0's 3 + 3 blocks and the head set the pace) or 1.428
(`balanced`, a split computed for 1F1B's separate end stages); budgeting the steady state's overlapped all-to-all
against the pair's whole compute (a forward chunk's traffic behind another micro-batch's backward) would take the
step to 13.24 s, ratio 1.50; hiding the stage-to-stage sends as well (§3.2.1: "both all-to-all and PP communication
can be fully hidden during execution"; priced as 1F1B's here, 0.36 s) to 13.84 s, ratio 1.44 (these three
figures are before the SMs below, which multiply the compute in each).

### Communication's SMs

DeepSeek-V3's all-to-all and pipeline kernels run on SMs taken from compute, all step: "only 20 SMs are sufficient
to fully utilize the bandwidths of IB and NVLink" (arXiv:2412.19437 §3.2.2), and §3.5.1 names the cost: 20 of the
H800's 132 SMs, which "will limit the computational throughput". `PlannerOptions.comm_sm_fraction` (0 by default:
NCCL's collectives are priced as costing no compute) scales every matmul peak by (1 − fraction)
(`cost_model.compute_share`); memory bandwidth is left whole (fewer SMs still reach it, and the source gives no
figure), and MFU keeps the whole device's peak as its denominator. The DeepSeek-V3 row states 20/132: its step goes
14.20 s -> 15.48 s and its ratio 1.402 -> 1.286 (no other row sets it, so no other moved). Nothing was fitted; the
24% that remains after this, the DualPipe gradient sums and FP8's quantization passes below has no sourced mechanism
here: the FP8 GEMMs' own rate under fine-grained scaling and FP32 promotion (§3.3.2, §3.5.2 "Support for Tile- and
Block-Wise Quantization": the dequantization runs on CUDA cores, "with significant data movement between Tensor Cores
and CUDA cores") is the likely one, and the report gives no GEMM rate; this run's GEMMs are priced at the bf16 runs'
efficiency of the FP8 peak.

### FP8's quantization passes

Fine-grained FP8 (arXiv:2412.19437 §3.3.2: activations scaled per 1x128 tile, online) costs element-wise passes
that §3.5.2 describes as they run on the H800: "we have to read 128 BF16 activation values (the output of the previous
computation) from HBM for quantization, and the quantized FP8 values are then written back to HBM, only to be read
again for MMA", and in the backward "the matrix needs to be read out, dequantized, transposed, re-quantized into
128x1 tiles, and stored in HBM". planner/fp8.py prices them at the device's memory bandwidth, per FP8 GEMM and
token: its input quantized online in the forward (2 + 1 B per element) and re-quantized transposed in the backward
(1 + 1 B), its output gradient quantized online in the backward (2 + 1 B). An input several GEMMs share is quantized
once (the normed hidden state for q, k, v or MLA's down-projections; a MoE block's input and output gradient once,
around the dispatch, §3.3.3); column-parallel inputs and row-parallel outputs are whole on every TP rank (split by
SP), the others split by TP. Not counted: a transposed copy of the output gradient (not stated), the per-tile scaling
factors, the weights' block quantization (once per step). DeepSeek-V3, per token and block: 51,200 input and 110,656
output-gradient elements, 0.59 MB; the step 15.67 s -> 16.09 s (compute 13.25 -> 13.64 s), ratio 1.271 -> 1.237.
Only fp8 runs pay it; no other row moved.

### Not modelled (known limits)

Stragglers and jitter at thousands of nodes; NVLS / SHARP in-network reductions; congestion between concurrent
collectives beyond the per-link budget; NCCL's PAT algorithm (logarithmic all-gather / reduce-scatter latency);
context parallelism; zero-bubble schedules (priced as 1F1B / interleaved); DualPipe's pipeline sends (priced as
1F1B's) and its steady-state overlap of a forward chunk's all-to-all with another micro-batch's backward; fp8's
fine-grained
scaling and its FP32 promotion of partial sums (fp8 GEMMs at the bf16 runs' efficiency) and the fp8 activations'
per-tile scaling factors; DualPipe's stage layout in memory (its time follows rank r's two stages; its memory is
priced per stage, "Memory"); dense and MoE blocks placed on
particular stages (every block is their average); the all-gather over NVLink that re-assembles a scatter/gather stage message on arrival
(Megatron-LM's gather, DeepSpeed's `PartitionedTensor.full()`; ~0.3% of MT-NLG's step); per-framework engine overheads per micro-batch (device synchronisations such as GPT-NeoX's
`synchronize-each-layer`, BLOOM's `CUDA_LAUNCH_BLOCKING=1`); a parallel block's single forward reduction under
sequence parallelism (priced as the sequential block's gather/scatter pairs); the runtime's fp32-parameter AMP layout on
GPU presets (they use Megatron's bf16 weights + fp32 master; calibrated CPU profiles use the runtime's layout).

### Design decisions

- The cost model stays closed-form and vectorised (one numpy pass over every configuration), so adding topology,
  stage splits and expert parallelism keeps LLaMA-2 70B on 1024 GPUs well under the 2 s budget.
- Pruning before pricing is exact, never heuristic: only configurations that a lower bound of the cost model's own
  memory proves infeasible are skipped (no time bound, no cap on micro-batch sizes), so the ranked plans are the
  same with `search(..., prune=False)`; the explanation counts the skipped ones among those that do not fit, and
  its "fastest that does not fit" note looks only at those priced. The fastest-regardless-of-memory comparison
  (`published.search_best(feasible_only=False)`) prices everything.
- Framework behaviour that changes a run's cost is a `PlannerOptions` fact set per published run from the
  framework's source (DeepSpeed's serial blocking stage transfers, its stage messages partitioned over the TP group,
  gradient sync after the pipeline drains), never a per-run factor.
- What the runtime cannot run is priced but never silently converted: a plan with ep > 1, a non-even split or
  DualPipe raises NotImplementedError in `to_strategy_dict`; `auto_mode="full"` and the monitor's re-plan search only
  the even split and ep = 1, and no search proposes DualPipe unless its constraints allow it.
- Split policies, not per-stage layer lists, are the search dimension (three named splits; duplicates removed):
  an explicit list would multiply the space by the number of compositions of l into p parts.
- ZeRO-2/3 follow the runtime (full buffer, one reduce-scatter) by default; the DeepSpeed-style per-micro-batch
  reduce-scatter is an option, not a search dimension, because the runtime cannot run it.
- Calibrated CPU profiles (gloo, eager runtime) keep the flat per-link alpha-beta or measured fits and the
  eager-runtime terms; the hierarchical model applies to NCCL GPU clusters.
- The constants were refitted on the same two Megatron-LM rows after the communication model changed
  (NVLink at its achieved bus bandwidth, fp32 gradient reduction): gemm_efficiency {opts.gemm_efficiency},
  activation_traffic_factor {opts.activation_traffic_factor}.
- A published throughput is compared in the unit it was published in: when a framework counted its TFLOP/s
  its own way (GPT-NeoX's 6·Ψ + 60·s·h·l per token) the prediction is converted with that count
  (`PublishedRun.flop_counter`), so a counting convention is never mistaken for a modelling error.
- A pipeline (pp > 1) needs at least pp micro-batches per step, in `invalid_reason` and the structural grid alike:
  that is what the runtime's 1F1B runs (`Strategy.validate` refuses fewer), so the search never ranks a plan
  the runtime would refuse. The training jobs do not consult the planner (only `ap.parallelize(auto_mode="full")`
  and the monitor's re-plan do, and both take the planner's Strategy).
- The planner's modules, `planner/cluster.py` and `comm/cost.py` import no paddle
  (`tests/test_planner_pure.py` plans with paddle blocked); the cost model is split along its ideas:
  `params.py` (parameters per block and stage), `stages.py` (blocks per stage), `stage_memory.py` (memory of
  the stage that needs most and the pruning bounds, one formula for both), `links.py` (streams on links),
  `cost_model.py` (step time).
"""


def sweep_md() -> str:
    """The hand-written section on MegaScale's sweeps (what was searched, the facts and their place in the paper),
    kept in tools/bench/planner_sweep.md so that regenerating docs/planner.md keeps it."""
    with open(os.path.join(os.path.dirname(__file__), "planner_sweep.md")) as f:
        return f.read()
