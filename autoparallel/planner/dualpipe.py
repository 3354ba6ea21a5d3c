"""DeepSeek's DualPipe schedule: its validity rules, its bubble, and the device that sets its pace.

Source: DeepSeek-AI 2024, DeepSeek-V3 Technical Report (arXiv:2412.19437) §3.2.1 and Table 2, and the
deepseek-ai/DualPipe repository (README.md, dualpipe/dualpipe.py, examples/example_dualpipe.py). Table 2 (the
README's "Pipeline Bubbles and Memory Usage Comparison"):

    1F1B      bubble (PP-1)(F+B)           parameters 1x   activations PP
    ZB1P      bubble (PP-1)(F+B-2W)        parameters 1x   activations PP
    DualPipe  bubble (PP/2-1)(F&B+B-3W)    parameters 2x   activations PP+1

"F denotes the execution time of a forward chunk, B denotes the execution time of a full backward chunk, W denotes
the execution time of a "backward for weights" chunk, and F&B denotes the execution time of two mutually overlapped
forward and backward chunks." §3.2.1: "DualPipe only requires that the pipeline stages and micro-batches be
divisible by 2"; dualpipe.py's ``step`` asserts ``num_ranks % 2 == 0`` and ``num_chunks % 2 == 0 and num_chunks >=
num_ranks * 2``. The schedule has no virtual stages.

Layout (examples/example_dualpipe.py): rank r holds stages r and PP-1-r and runs half the micro-batches through
each, so a device's steady-state work per micro-batch is the mean of its two stages' (``device_blocks``): with
equal stages that is 1F1B's, and only the bubble differs. Rank 0 holds both end stages (the embedding and the
output head), so under a split that lightens the end stages (``ends``) rank 0 is lighter than the others, and the
slowest device is the rank whose two stages hold most blocks together, not the fullest stage.

F&B is priced as F + B: the two chunks' compute on one device does not speed up by being interleaved (§3.2.1 gives
communication its own SMs: "we manually adjust the ratio of GPU SMs dedicated to communication versus computation"),
and what the overlap hides is the communication (the expert all-to-all), so F&B is at least the communication the two
chunks put on their busiest link (``overlapped_pair_seconds``). §3.2.1 also says "we can ensure that both all-to-all
and PP communication can be fully hidden during execution": the all-to-all is hidden where the run says so
(``PlannerOptions.moe_a2a_overlap``, within each link's budget); the stage-to-stage sends stay priced as 1F1B's.
"""
from __future__ import annotations

import numpy as np

# ParallelConfig.schedule's name for it, and the source the planner-only note names
NAME = "DualPipe"
SOURCE = "DeepSeek-AI 2024, arXiv:2412.19437 §3.2.1"


def problem(pp: int, vpp: int, micro_batches: int):
    """Why DualPipe cannot run ``pp`` stages with ``vpp`` virtual stages and ``micro_batches`` micro-batches per
    step, or None (§3.2.1: stages and micro-batches divisible by 2; dualpipe.py ``step``: at least 2·PP
    micro-batches; no virtual stages)."""
    if pp < 2:
        return f"DualPipe needs pipeline parallelism (pp >= 2), got pp={pp}"
    if vpp != 1:
        return f"DualPipe has no virtual stages (arXiv:2412.19437 §3.2.1), got vpp={vpp}"
    if pp % 2 or micro_batches % 2:
        return (f"DualPipe needs an even number of pipeline stages and an even number of micro-batches "
                f"(arXiv:2412.19437 §3.2.1), got pp={pp} and {micro_batches} micro-batches")
    if micro_batches < 2 * pp:
        return (f"DualPipe needs at least 2·pp = {2 * pp} micro-batches per step (deepseek-ai/DualPipe "
                f"dualpipe.py: num_chunks >= num_ranks * 2), got {micro_batches}")
    return None


def one_f_one_b_bubble(p, F, B):
    """1F1B's bubble, Table 2: (PP-1)(F+B)."""
    return (p - 1) * (F + B)


def zb1p_bubble(p, F, B, W):
    """ZB1P's bubble (zero-bubble 1F1B), Table 2: (PP-1)(F+B-2W)."""
    return (p - 1) * (F + B - 2 * W)


def dualpipe_bubble(p, FB, B, W):
    """DualPipe's bubble, Table 2: (PP/2-1)(F&B+B-3W), with F&B the overlapped forward-and-backward pair."""
    return (p / 2.0 - 1.0) * (FB + B - 3.0 * W)


def overlapped_pair_seconds(F, B, pair_link_busy):
    """F&B: two mutually overlapped chunks take their compute, F + B, but no less than the communication they
    overlap on its busiest link (the module docstring's assumption)."""
    return np.maximum(F + B, pair_link_busy)


def pair_blocks(counts) -> tuple:
    """Blocks of rank 0's two stages together (stages 0 and PP-1) and the most any other rank's two stages (r and
    PP-1-r) hold together (0 when PP = 2: rank 1 holds the same two stages)."""
    p = len(counts)
    pairs = [counts[r] + counts[p - 1 - r] for r in range(1, p // 2)]
    return counts[0] + counts[-1], max(pairs, default=0)


def rank_loads(counts) -> tuple:
    """Per rank r < PP/2, (blocks held, block-micro-batches of activations in flight): rank r holds stages r and
    PP-1-r (deepseek-ai/DualPipe example_dualpipe.py), and keeps stage r's activations for PP - r micro-batches (its
    place in the forward direction) and stage PP-1-r's for r + 1 (its place in the reverse one), PP + 1 in all as
    Table 2 has it. Rank PP-1-r holds the same two stages with the same counts."""
    p = len(counts)
    return tuple((counts[r] + counts[p - 1 - r], counts[r] * (p - r) + counts[p - 1 - r] * (r + 1))
                 for r in range(p // 2))


def device_blocks(end_pair, mid_pair, pp, dual, n_first, n_last, n_mid):
    """Blocks per micro-batch and output-head share of the pipeline rows the cost model compares (first, last,
    middle). 1F1B: each stage's blocks, the head on the last stage. DualPipe: rank 0 runs half the micro-batches
    through stage 0 and half through stage PP-1, (n_0 + n_{PP-1})/2 blocks and half the head per micro-batch; the
    other ranks (the middle row) (n_r + n_{PP-1-r})/2 at most; there is no separate last row."""
    heads = (np.where(pp == 1, 1.0, np.where(dual, 0.5, 0.0)), np.ones(len(pp)), np.zeros(len(pp)))
    first = np.where(dual, end_pair / 2.0, n_first)
    mid = np.where(dual, mid_pair / 2.0, n_mid)
    live = (np.ones(len(pp), bool), (pp > 1) & ~dual, pp > 2)
    return (first, n_last, mid), heads, live
