"""The monitor's report: a per-rank table of mean milliseconds per step, skews, and an optional PNG."""
from __future__ import annotations

from autoparallel.monitoring.steps import _KEY


class ReportingMixin:
    """``report()`` of ``PerformanceMonitor`` (it supplies the measurements)."""

    def report(self, png: str = None) -> str:
        per_rank = self._per_rank()
        ranks = sorted(per_rank)
        keys = sorted({k for t in per_rank.values() for k in t}, key=_sort_key)
        width = max([len(k) for k in keys] + [8])
        lines = [f"PerformanceMonitor: mean ms per step over {len(self._totals)} measured steps "
                 f"(after {self.warmup_steps} warm-up)",
                 f"{'key':<{width}}  " + "  ".join(f"{'rank ' + str(r):>9}" for r in ranks)]
        for k in keys:
            lines.append(f"{k:<{width}}  " + "  ".join(
                f"{per_rank[r][k] * 1e3:9.3f}" if k in per_rank[r] else f"{'-':>9}" for r in ranks))
        imb = self.imbalance()
        if imb["rank_steps"]:
            lines.append(f"rank skew of 'step': {imb['ranks'] * 100:.1f}% (slowest rank {imb.get('slowest_rank')})")
        if imb["stage_times"]:
            stages = ", ".join(f"{t * 1e3:.2f}" for t in imb["stage_times"])
            lines.append(f"stage times (ms): {stages}; skew {imb['stages'] * 100:.1f}% "
                         f"(slowest stage {imb.get('slowest_stage')})")
        text = "\n".join(lines)
        if png is not None:
            _plot(per_rank, keys, png)
        return text


def _sort_key(key: str):
    m = _KEY.match(key)
    return (m.group(1), int(m.group(2))) if m else (key, -1)


def _plot(per_rank: dict, keys: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted(per_rank)
    fig, ax = plt.subplots(figsize=(max(6, len(keys) * 0.6), 4))
    width = 0.8 / max(len(ranks), 1)
    for j, r in enumerate(ranks):
        ax.bar([i + j * width for i in range(len(keys))], [per_rank[r].get(k, 0.0) * 1e3 for k in keys],
               width=width, label=f"rank {r}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
    ax.set_xticklabels(keys, rotation=45, ha="right")
    ax.set_ylabel("ms per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
