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


def _never_started_note(peers) -> str:
    """What to say of watched ranks that never published a heartbeat ("" when every one did): the cause of a
    failure (an exception before their first autoparallel call) is in their own logs, not here."""
    never = sorted(p.rank for p in peers if not p.up)
    if not never:
        return ""
    return (f"; rank{'s' if len(never) > 1 else ''} {', '.join(map(str, never))} never started a watchdog: "
            f"{'they' if len(never) > 1 else 'it'} ended or stalled before the first autoparallel call that "
            f"starts one (ap.init_parallel_env, ap.shard_layer, ap.parallelize) -- its own log holds the cause")


def _ended_note(peers) -> str:
    """What to say of watched ranks whose processes ended cleanly ("" when none did): a collective of this rank's
    that failed or hangs may be one they never made (a loop of another length, ``sys.exit(0)``)."""
    ended = sorted((p.rank, _their_op(p.record)) for p in peers if p.record.get("exiting") and not
                   p.record.get("error"))
    if not ended:
        return ""
    who = ", ".join(f"rank {r} (last in {op})" for r, op in ended)
    them = "them" if len(ended) > 1 else "it"
    return (f"; {who} ended {'their processes' if len(ended) > 1 else 'its process'} cleanly (the script returned "
            f"or called sys.exit): a collective that needs {them} can never be joined (the ranks ran different "
            f"numbers of steps or collectives, or `sys.exit(0)` on some ranks)")


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
