"""PNG of a plan: per-device memory breakdown and step-time breakdown of the top candidates."""
from __future__ import annotations

TIME_COLORS = {"compute": "#4c72b0", "recompute": "#8172b2", "tp_comm": "#dd8452", "zero3_gather": "#937860",
               "bubble": "#c44e52", "pp_comm": "#da8bc3", "dp_comm": "#55a868", "optimizer": "#8c8c8c",
               "overhead": "#ccb974", "ep_comm": "#64b5cd"}
MEMORY_COLORS = {"params": "#4c72b0", "grads": "#55a868", "optimizer": "#c44e52", "activations": "#dd8452",
                 "zero3_buffer": "#937860", "reserve": "#cccccc"}


def plot_plan(result, path: str) -> str:
    """Save two panels: stacked memory per device and stacked step time, one bar per candidate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cands = list(result.candidates)
    if result.reference is not None and all(c.config != result.reference.config for c in cands):
        cands.append(result.reference)
    labels = []
    for i, c in enumerate(cands):
        k = c.config
        tag = "ref" if (result.reference is c and i >= len(result.candidates)) else f"#{i + 1}"
        labels.append(f"{tag} dp{k.dp} tp{k.tp} pp{k.pp}\nv{k.vpp} sp{k.sp} z{k.sharding} {k.recompute[:3]} "
                      f"o{k.offload} mb{k.micro_batch}")
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(cands) + 4), 5))
    x = range(len(cands))
    bottom = [0.0] * len(cands)
    for key, color in MEMORY_COLORS.items():
        values = [c.memory_gb.get(key, 0.0) for c in cands]
        ax_mem.bar(x, values, bottom=bottom, color=color, label=key)
        bottom = [b + v for b, v in zip(bottom, values)]
    if cands:
        ax_mem.axhline(cands[0].capacity_gb, color="black", linestyle="--", linewidth=1, label="capacity")
    ax_mem.set_xticks(list(x))
    ax_mem.set_xticklabels(labels, fontsize=7)
    ax_mem.set_ylabel("GB per device")
    ax_mem.set_title("memory per device")
    ax_mem.legend(fontsize=7)
    bottom = [0.0] * len(cands)
    for key, color in TIME_COLORS.items():
        values = [c.time_s.get(key, 0.0) for c in cands]
        ax_time.bar(x, values, bottom=bottom, color=color, label=key)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_time.set_xticks(list(x))
    ax_time.set_xticklabels(labels, fontsize=7)
    ax_time.set_ylabel("seconds per step")
    ax_time.set_title("predicted step time")
    ax_time.legend(fontsize=7)
    fig.suptitle(f"{result.model.name} on {result.cluster.name}, global batch {result.global_batch_size}, "
                 f"seq {result.seq_len}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
