"""PlannerOptions: the cost model's constants and modelling assumptions, one commented field each.

The two efficiency constants are fitted on two rows of Megatron-LM's weak-scaling table
(see ``autoparallel.planner.megatron``); every other number is a hardware fact or a stated assumption.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

# (param bytes, grad bytes, optimizer-state bytes) per parameter for each precision:
#   bf16: bf16 weight 2 + bf16 grad 2 + fp32 master, Adam m and v 12 = 16 (mixed-precision Adam)
#   fp32: fp32 weight 4 + fp32 grad 4 + Adam m and v 8            = 16
#   fp8: linear layers' matmuls at the fp8 peak, the attention core, output head and router at the bf16 peak
#        (CORE_DTYPES), plus the quantization passes (planner/fp8.py), weights/activations/states stored as bf16
#        (planner-only: the runtime has no fp8)
PRECISIONS = {"bf16": (2, 2, 12, "bfloat16"), "fp32": (4, 4, 8, "float32"), "fp8": (2, 2, 12, "float8")}
PLANNER_ONLY_PRECISIONS = ("fp8",)
# GEMMs outside the linear layers keep 16-bit under fp8 training (DeepSeek-AI 2024, arXiv:2412.19437 §3.3.1: the
# linear layers' Fprop, Dgrad and Wgrad run in FP8 while "the embedding module, the output head, MoE gating
# modules, normalization operators, and attention operators" keep BF16/FP32): precision -> the dtype of the
# attention core (scores and context), the output head and the router; absent: the compute dtype
CORE_DTYPES = {"fp8": "bfloat16"}


@dataclass(frozen=True)
class PlannerOptions:
    # -- fitted on Megatron-LM Table 1 rows 1.7B and 145B (planner/megatron.py, tests/test_planner_calibration.py)
    gemm_efficiency: float = 0.661                # sustained fraction of peak FLOP/s of a block's matmuls
    linear_gemm_efficiency: float = 0.0           # the linear layers' GEMMs at a measured kernel's fraction of the
                                                  # compute dtype's peak instead (fine-grained FP8 GEMMs:
                                                  # planner/fp8.py, DeepGEMM's H800 table); 0: gemm_efficiency
    activation_traffic_factor: float = 2.04       # device-memory bytes moved per stored activation byte (element-wise ops)
    # -- numerics
    precision: str = "bf16"                       # "bf16" (mixed precision, 16-bit activations) or "fp32"
    flash_attention: bool = False                 # attention scores never materialised (no a·s² activations)
    grad_accum_fp32: bool = True                  # 16-bit runs accumulate and reduce gradients in an fp32 buffer (4 B/param:
                                                  # Megatron's main_grad, DeepSpeed's bf16 optimizer, this runtime's AMP)
    # -- activation and optimizer-state storage (DeepSeek-AI 2024, arXiv:2412.19437; the defaults: 16-bit
    #    activations, everything stored, fp32 Adam moments). Need a 16-bit precision (bf16 or fp8).
    linear_input_bytes: float = 0.0               # bytes per element of the inputs the Linear layers cache for backward
                                                  # (§3.3.3 "cache activations in FP8 format for the backward pass of the
                                                  # Linear operator": 1); 0: the activation dtype's (2)
    attention_output_bytes: float = 0.0           # bytes per element of the input of the Linear after attention (§3.3.3
                                                  # "a customized E5M6 data format": 12 bits, 1.5); 0: linear_input_bytes
    moe_swiglu_recompute: bool = False            # MoE blocks cache the SwiGLU inputs (at linear_input_bytes) and
                                                  # recompute its output in backward (§3.3.3 (2)); its time is priced
    recompute_norm_up_projection: bool = False    # RMSNorm and MLA up-projection outputs recomputed in backward, not
                                                  # stored (§3.2.3); the up-projections' GEMMs and the norms' traffic
                                                  # are priced as recompute time
    optimizer_moment_bytes: float = 4.0           # bytes of each AdamW moment (§3.3.3 "the BF16 data format instead of
                                                  # FP32 to track the first and second moments": 2); master weights
                                                  # and gradients stay fp32
    # -- memory
    memory_reserve_fraction: float = 0.10         # device memory kept free: runtime context, comm buffers, fragmentation
    host_memory_reserve_fraction: float = 0.25    # host RAM kept for the OS, data loaders and pinned staging buffers
    # -- ZeRO-2/3 gradients with m > 1 micro-batches: False = accumulate the full buffer locally and reduce-scatter
    #    once (what parallel/reducer.py does); True = reduce-scatter every micro-batch, keep only the shard
    zero_grad_per_micro_batch: bool = False
    grad_sync_overlap: bool = True                # the gradient sync starts during the last backward (the runtime's
                                                  # Reducer); False: after the pipeline drains (DeepSpeed's pipeline
                                                  # engine, Megatron-LM 2021), fully exposed
    grad_bucket_bytes: float = 25 * 2 ** 20       # gradients reduce in buckets (the runtime's 25 MiB); each bucket's
                                                  # collective pays its latency, which grows with the group
    # -- mixture of experts
    moe_imbalance: float = 1.1                    # tokens of the busiest expert rank / the mean (dropless routing with
                                                  # load balancing); expert compute runs at the busiest rank's pace
    moe_a2a_overlap: bool = False                 # expert all-to-all overlapped with another micro-batch's compute
                                                  # (DeepSeek's DualPipe overlaps it), within each link's budget; else
                                                  # exposed. DualPipe itself is a schedule: ParallelConfig.dualpipe
    comm_sm_fraction: float = 0.0                 # share of each device's SMs held by communication kernels that run
                                                  # beside compute all step (DeepSeek-AI 2024, arXiv:2412.19437 §3.2.2:
                                                  # "only 20 SMs are sufficient"; §3.5.1: 20 of the H800's 132, which
                                                  # "will limit the computational throughput"): the matmul peaks scale
                                                  # by (1 - this); 0: collectives cost no compute
    # -- pipeline
    pp_scatter_gather: bool = True                # stage-to-stage messages split over the TP group (Narayanan et al. §4.1;
                                                  # DeepSpeed's pipeline engine likewise: PartitionedTensor over TP)
    pp_serial_p2p: bool = False                   # a stage's send and receive of one schedule step run one after the
                                                  # other, blocking (DeepSpeed's pipeline engine: TrainSchedule steps
                                                  # carry SendGrad+RecvActivation or RecvGrad+SendActivation, p2p.py's
                                                  # send/recv are blocking); False: batched with the neighbour
                                                  # (Megatron-LM's send_forward_recv_backward)
    # -- offload (ZeRO-Offload: optimizer states and their update on the host)
    host_link_bandwidth_Bps: float = None         # device<->host bytes/s per device; None: the cluster topology's PCIe
    host_adam_params_per_s: float = 2.5e8         # parameters/s one device's share of host cores updates with Adam
    # -- the eager runtime's bookkeeping (set for calibrated CPU profiles, see options_for_cluster)
    zero_master_copy: bool = False                # ZeRO keeps an fp32 master chunk (stage 1-2) and its gradient (stage 1)
    optimizer_tensor_bytes: float = 0.0           # optimizer state per parameter tensor (paddle AdamW's beta powers: 8)
    # -- search space limits
    max_vpp: int = 16                             # largest number of virtual stages per device considered

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if not 0 < self.gemm_efficiency <= 1:
            raise ValueError(f"gemm_efficiency must be in (0, 1], got {self.gemm_efficiency}")
        if not 0 <= self.linear_gemm_efficiency <= 1:
            raise ValueError(f"linear_gemm_efficiency must be in [0, 1] (0: gemm_efficiency), got "
                             f"{self.linear_gemm_efficiency}")
        if self.activation_traffic_factor < 0:
            raise ValueError(f"activation_traffic_factor must be >= 0, got {self.activation_traffic_factor}")
        if not 0 <= self.memory_reserve_fraction < 1:
            raise ValueError(f"memory_reserve_fraction must be in [0, 1), got {self.memory_reserve_fraction}")
        if not 0 <= self.host_memory_reserve_fraction < 1:
            raise ValueError(f"host_memory_reserve_fraction must be in [0, 1), got {self.host_memory_reserve_fraction}")
        if not self.grad_bucket_bytes > 0:
            raise ValueError(f"grad_bucket_bytes must be > 0, got {self.grad_bucket_bytes}")
        self._check_storage()
        if not 0 <= self.comm_sm_fraction < 1:
            raise ValueError(f"comm_sm_fraction is the share of a device's SMs held by communication and must be in "
                             f"[0, 1), got {self.comm_sm_fraction}")
        if not self.moe_imbalance >= 1:
            raise ValueError(f"moe_imbalance is the busiest expert rank's load over the mean and must be >= 1, got "
                             f"{self.moe_imbalance}")

    def _check_storage(self):
        for name in ("linear_input_bytes", "attention_output_bytes"):
            value = getattr(self, name)
            if not 0 <= value <= 2:
                raise ValueError(f"{name} is bytes per cached element (0: the 16-bit default) and must be in [0, 2], "
                                 f"got {value}")
        if not 0 < self.optimizer_moment_bytes <= 4:
            raise ValueError(f"optimizer_moment_bytes must be in (0, 4], got {self.optimizer_moment_bytes}")
        stored_differently = (self.linear_input_bytes or self.attention_output_bytes or self.moe_swiglu_recompute
                              or self.recompute_norm_up_projection)
        if stored_differently and self.activation_scale != 1.0:
            raise ValueError(f"linear_input_bytes, attention_output_bytes, moe_swiglu_recompute and "
                             f"recompute_norm_up_projection describe 16-bit training and need precision bf16 or fp8, "
                             f"got {self.precision!r}")

    @property
    def linear_efficiency(self) -> float:
        """Sustained fraction of the compute dtype's peak of the linear layers' GEMMs."""
        return self.linear_gemm_efficiency or self.gemm_efficiency

    @property
    def param_bytes(self) -> int:
        return PRECISIONS[self.precision][0]

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element held and reduced: the fp32 accumulation buffer for 16-bit runs."""
        stored = PRECISIONS[self.precision][1]
        return 4 if self.grad_accum_fp32 else stored

    @property
    def planner_only(self) -> bool:
        """The precision is priced but the runtime cannot run it (fp8)."""
        return self.precision in PLANNER_ONLY_PRECISIONS

    @property
    def optimizer_bytes(self) -> float:
        """Optimizer-state bytes per parameter: the precision's (fp32 master and moments) with each of Adam's two
        moments at ``optimizer_moment_bytes`` instead of 4 (bf16/fp8: 4 + 2 + 2 = 8 with BF16 moments)."""
        return PRECISIONS[self.precision][2] - 2.0 * (4.0 - self.optimizer_moment_bytes)

    @property
    def compute_dtype(self) -> str:
        return PRECISIONS[self.precision][3]

    @property
    def core_dtype(self) -> str:
        """dtype of the attention core, the output head and the MoE router (bf16 under fp8, see CORE_DTYPES)."""
        return CORE_DTYPES.get(self.precision, self.compute_dtype)

    @property
    def activation_scale(self) -> float:
        """Korthikanti's byte counts assume 16-bit activations; fp32 doubles them."""
        return self.param_bytes / 2.0

    def replace(self, **changes) -> "PlannerOptions":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


def options_for_cluster(cluster, options: PlannerOptions = None) -> PlannerOptions:
    """Options given explicitly win; otherwise a calibrated profile's facts ("precision", "gemm_efficiency")
    override the defaults (a measured matmul rate is already sustained, so its profile says gemm_efficiency 1),
    and a profile with eager-runtime costs counts the runtime's ZeRO master chunks and AdamW beta powers."""
    if options is not None:
        return options
    facts = dict(cluster.extra)
    changes = {}
    if getattr(cluster, "runtime", None) is not None:       # the eager runtime on CPU ranks (fp32, paddle AdamW)
        changes.update(zero_master_copy=True, optimizer_tensor_bytes=8.0)
    if "precision" in facts:
        changes["precision"] = str(facts["precision"])
    if "gemm_efficiency" in facts:
        changes["gemm_efficiency"] = float(facts["gemm_efficiency"])
    return PlannerOptions(**changes)
