"""The breakdowns as a text table and as stacked bars per rank (PNG, matplotlib)."""
from __future__ import annotations

from autoparallel.profiler.breakdown import PARTS

_SHORT = {"compute: dispatched ops": "ops", "compute: backward": "backward", "compute: optimizer": "optim",
          "compute: other": "other", "dispatch overhead": "dispatch",
          "reshard": "reshard", "comm overhead": "comm ovh", "collectives": "coll", "idle wait": "wait",
          "pipeline bubble": "bubble"}
_COLORS = ("#4c72b0", "#64b5cd", "#8172b3", "#8fb0e0", "#dd8452", "#c44e52", "#937860", "#55a868", "#8c8c8c", "#ccb974")


def _label(rank) -> str:
    return "sim" if rank == -1 else str(rank)


def table(breakdowns: dict) -> str:
    """Per rank: the step time and each part (ms, % of the step); then per collective kind."""
    head = f"{'rank':>4} {'step ms':>9} " + " ".join(f"{_SHORT[p]:>9}" for p in PARTS) + f" {'ops':>6} {'us/op':>6}"
    lines = ["step-time breakdown (ms; parts add up to the step)", head]
    for r, b in breakdowns.items():
        cells = " ".join(f"{b.parts[p] * 1e3:9.2f}" for p in PARTS)
        lines.append(f"{_label(r):>4} {b.step_s * 1e3:9.2f} {cells} {b.counts['dispatched ops']:6.0f} "
                     f"{b.per_op_us():6.1f}")
    for r, b in breakdowns.items():
        pct = " ".join(f"{100 * b.parts[p] / b.step_s if b.step_s else 0:8.1f}%" for p in PARTS)
        lines.append(f"{_label(r):>4} {'(share)':>9} {pct}")
    lines += ["", f"{'rank':>4} {'collective':<16} {'count':>6} {'MB sent':>9} {'ms':>9} {'wait ms':>9}"]
    for r, b in breakdowns.items():
        for kind, k in sorted(b.collectives.items()):
            lines.append(f"{_label(r):>4} {kind:<16} {k['count']:6.0f} {k['bytes'] / 1e6:9.3f} "
                         f"{k['seconds'] * 1e3:9.2f} {k['wait'] * 1e3:9.2f}")
    lines.append("parts: " + "; ".join(f"{_SHORT[p]} = {p}" for p in PARTS)
                 + "; ops = dispatched ops; us/op = dispatch overhead per dispatched op")
    hooks = ", ".join(f"{_label(r)}: {b.hook_s * 1e3:.2f} ms over {b.counts.get('hooked calls', 0):.0f} hooked calls"
                      for r, b in breakdowns.items())
    lines.append(f"the profile's own hooks (estimated, inside the parts): {hooks}")
    return "\n".join(lines)


def plot(breakdowns: dict, path: str, title: str = "step-time breakdown per rank") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = list(breakdowns)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(ranks) + 3.0), 4.5))
    bottom = [0.0] * len(ranks)
    x = list(range(len(ranks)))
    for part, color in zip(PARTS, _COLORS):
        vals = [breakdowns[r].parts[part] * 1e3 for r in ranks]
        if any(vals):
            ax.bar(x, vals, bottom=bottom, color=color, label=part, width=0.6)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(x)
    ax.set_xticklabels([f"rank {_label(r)}" for r in ranks])
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
