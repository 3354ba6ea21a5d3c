"""What a watchdog writes: the reason a peer is judged lost, notes on its process, and quiet, bounded I/O."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading

from autoparallel.watchdog_store import process_state


def _exited_reason(exited: list) -> str:
    """The loss to report when the processes of ``exited`` peers are gone: the one silent for longest."""
    first = min(exited, key=lambda p: p.changed)
    rec = first.record
    later = sorted(p.rank for p in exited if p is not first)
    also = f"; ranks {later} have exited since" if later else ""
    return (f"rank {first.rank} lost: its process (pid {rec['pid']} on this host) has exited; it was last in "
            f"{_their_op(rec)}{also}")


def _process_note(record: dict, host: str) -> str:
    """What /proc says about the process of a record from this host ("" for other hosts)."""
    if record.get("host") != host or "pid" not in record:
        return ""
    state = process_state(record["pid"], record.get("start"))
    return {"stopped": f"; its process (pid {record['pid']} on this host) is stopped (SIGSTOP?)",
            "exited": f"; its process (pid {record['pid']} on this host) has exited",
            "running": f"; its process (pid {record['pid']} on this host) is running but silent"}.get(state, "")


def _their_op(record: dict) -> str:
    op = record.get("op")
    step = record.get("step")
    text = f"'{op}'" if op else "no operation"
    return text + (f" (step {step})" if step is not None else "")


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def _bounded(fn, seconds: float) -> None:
    """Run ``fn`` in a daemon thread, waiting at most ``seconds`` (a frozen store must not hold us)."""
    t = threading.Thread(target=_quiet, args=(fn,), daemon=True)
    t.start()
    t.join(seconds)


def _quiet(fn) -> None:
    try:
        fn()
    except Exception:
        pass


def _write_stderr(text: str) -> None:
    data = (text.rstrip("\n") + "\n").encode(errors="replace")
    with contextlib.suppress(OSError):
        sys.stderr.flush()
        os.write(2, data)
