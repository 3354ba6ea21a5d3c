"""Timeline pictures of a pipeline: one row per rank, time to the right, F/B/W boxes per micro-batch.

Input is a list of ``(rank, kind, stage, microbatch, start, end)`` records, so the same call draws a
simulated schedule (``SimResult.records()``) and one measured by a runtime. Virtual stages (VPP chunks)
of a rank get lighter shades of their kind's colour. The title carries the bubble fraction.
"""
from __future__ import annotations

from typing import Optional

from .simulate import Record, bubble_fraction, simulate

COLORS = {"F": (0.25, 0.47, 0.85), "B": (0.20, 0.65, 0.35), "W": (0.60, 0.40, 0.80)}
NAMES = {"F": "forward", "B": "backward", "W": "weight grad"}


def _shade(rgb: tuple, chunk: int, chunks: int) -> tuple:
    mix = 0.55 * chunk / max(chunks - 1, 1)            # chunk 0 darkest, last chunk lightest
    return tuple(c + (1 - c) * mix for c in rgb)


def plot_timeline(records, path: Optional[str] = None, title: str = "pipeline", num_ranks: Optional[int] = None,
                  time_unit: str = ""):
    """Draw records as a timeline; save a PNG when ``path`` is given. Returns the matplotlib Figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    recs = [Record(*r) for r in records]
    recs = [r for r in recs if r.kind in COLORS]
    if not recs:
        raise ValueError("plot_timeline needs at least one F/B/W record, got none")
    ranks = num_ranks if num_ranks is not None else max(r.rank for r in recs) + 1
    chunks = max(r.stage // ranks for r in recs) + 1
    t0 = min(r.start for r in recs)
    span = max(r.end for r in recs) - t0
    frac = bubble_fraction(recs, ranks)

    fig, ax = plt.subplots(figsize=(min(22, 4 + 0.18 * len(recs) / ranks * 2), 0.5 * ranks + 1.3))
    for r in recs:
        width = r.end - r.start
        ax.barh(r.rank, width, left=r.start - t0, height=0.8,
                color=_shade(COLORS[r.kind], r.stage // ranks, chunks), edgecolor="white", linewidth=0.6)
        if width > span / 120:
            ax.text(r.start - t0 + width / 2, r.rank, str(r.microbatch), ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {i}" for i in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel(f"time{f' ({time_unit})' if time_unit else ''}")
    ax.set_title(f"{title} — bubble {frac:.1%}, makespan {span:.4g}", loc="left", fontsize=10)
    kinds = [k for k in COLORS if any(r.kind == k for r in recs)]
    handles = [Patch(color=COLORS[k], label=NAMES[k]) for k in kinds]
    if chunks > 1:
        handles.append(Patch(color=_shade((0.4, 0.4, 0.4), chunks - 1, chunks), label="later chunks lighter"))
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles), frameon=False,
              fontsize=8, borderaxespad=0.1)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def plot_schedule(schedule, path: Optional[str] = None, title: Optional[str] = None, **sim_kwargs):
    """Simulate a Schedule (``sim_kwargs`` go to ``simulate``) and draw it. Returns (Figure, SimResult)."""
    result = simulate(schedule, **sim_kwargs)
    name = getattr(schedule, "name", "schedule")
    if title is None:
        title = name
        if hasattr(schedule, "micro_batches"):
            title += f" pp={schedule.num_ranks} m={schedule.micro_batches}"
            title += f" vpp={schedule.vpp}" if schedule.vpp > 1 else ""
    return plot_timeline(result.records(), path, title=title, num_ranks=result.num_ranks), result
