"""Per-rank event logs of fault-injection runs: a rank appends JSON lines to ``<out>/rank<r>.jsonl`` (what it
wrote survives the rank being killed or stopped) and the launching process reads them back."""
from __future__ import annotations

import json
import os
import time


def note(out: str, rank: int, kind: str, **fields) -> None:
    """Append ``{"kind", "time", "pid", **fields}`` to this rank's log."""
    with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"kind": kind, "time": time.time(), "pid": os.getpid(), **fields}) + "\n")


def events_of(out: str, nproc: int) -> dict:
    """{rank: [event, ...]} of the ranks below ``nproc`` that wrote a log."""
    events = {}
    for r in range(nproc):
        path = os.path.join(out, f"rank{r}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                events[r] = [json.loads(line) for line in f if line.strip()]
    return events
