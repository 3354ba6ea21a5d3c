"""How the ranks of a real job agree during a save, without ever waiting inside a gloo collective.

gloo (paddle 3.3.1) aborts a collective after a fixed 30 s, and writing a large shard can take longer, so
ranks never wait for each other in a collective around the writes. The protocol is:

1. one small exchange before any reduction or write (save_agree.py: rank 0's nonce, the name of the temporary
   directory, and every rank's list of Partial reductions, which must agree); every rank arms the job's
   watchdog here if none runs yet (``watchdog.start_default``);
2. every rank writes its own data file, fsyncs it, and atomically drops ``rank-<r>.json`` (its shard index)
   into the temporary directory;
3. rank 0 polls the directory until every rank's marker is there, writes the metadata and commits;
4. the other ranks poll for the committed metadata carrying the same nonce (or a failure note).

Liveness comes from heartbeats, not from the polling: the watchdog's heartbeats run in a thread of their
own through the whole save, so a rank killed meanwhile is named at once (same host) and a frozen one
within the heartbeat timeout (at most 2 x while its process still runs a long write), and every rank exits
naming it and the operation in flight. ``AP_CKPT_TIMEOUT`` (default 3600 s) bounds the polling only as the
last resort when the watchdog is switched off (``AP_WATCHDOG=off``). The checkpoint directory must be on a
filesystem every rank sees (a shared filesystem across nodes): step 1 checks it before any write (shared_dir.py).

Steps rank 0 performs alone inside a collective save or restore (``latest``, pruning, the pointer's repair) share
their outcome through one small all_gather of a status (``rank_zero_step``): they run after the commit, when
every rank has just left the rendezvous, so nobody waits long in that collective.
"""
from __future__ import annotations

import os
import time
import warnings

POLL_S = 0.02
MAX_POLL_S = 0.5


def job() -> tuple:
    """(multi_process, rank, world_size) of the current world (the simulated world is one process)."""
    from autoparallel.comm.world import current_world

    world = current_world()
    if world.is_simulated:
        return False, 0, world.world_size
    import paddle.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() <= 1:
        return False, 0, 1
    return True, dist.get_rank(), dist.get_world_size()


def broadcast_token(token: str) -> str:
    """Rank 0's ``token`` (12 hex digits) on every rank, by one broadcast of a 2-element int64 tensor; arms
    the watchdog first (every rank of a save passes here together)."""
    multi, _, _ = job()
    if not multi:
        return token
    import paddle
    import paddle.distributed as dist

    from autoparallel import watchdog

    watchdog.start_default()
    value = int(token, 16)
    t = paddle.to_tensor([value >> 32, value & 0xFFFFFFFF], dtype="int64")
    with watchdog.op("checkpoint start (broadcast)"):
        dist.broadcast(t, src=0)
    hi, lo = (int(v) for v in t.numpy())
    return f"{(hi << 32) | lo:012x}"


def save_timeout() -> float:
    text = os.environ.get("AP_CKPT_TIMEOUT", "3600")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"AP_CKPT_TIMEOUT must be a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):      # inf would be a wait without end once the watchdog is off
        raise ValueError(f"AP_CKPT_TIMEOUT must be a positive finite number of seconds, got {text!r}")
    return value


_warned = [False]


def wait_until(ready, timeout: float, describe, what: str = "checkpoint rendezvous") -> None:
    """Poll ``ready()`` until true, as the operation ``what`` of this rank (named by the watchdog if a peer
    is lost meanwhile); TimeoutError with ``describe()`` after ``timeout`` seconds."""
    from autoparallel import watchdog

    if watchdog.current() is None and job()[0] and not _warned[0]:
        _warned[0] = True
        warnings.warn(f"{what} without a running watchdog (AP_WATCHDOG=off?): a rank lost meanwhile is noticed "
                      f"only after {timeout:.0f} s (AP_CKPT_TIMEOUT)", RuntimeWarning, stacklevel=2)
    deadline = time.monotonic() + timeout
    delay = POLL_S
    with watchdog.op(what):
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(describe())
            time.sleep(delay)
            delay = min(delay * 1.5, MAX_POLL_S)


STATUS_BYTES = 2048                 # one rank's status in gather_errors: its error's type name and text, cut to this


def gather_errors(error, what: str = "checkpoint status (all_gather)") -> list:
    """[(rank, error type name, text)] of every rank whose ``error`` is not None, the same list on every rank: one
    all_gather of a fixed-size status (``STATUS_BYTES``) from each rank, as the operation ``what``. In a single
    process (the simulated world included): this process's own error, as rank 0's."""
    multi, rank, _ = job()
    if not multi:
        return [] if error is None else [(0, type(error).__name__, str(error))]
    import numpy as np
    import paddle
    import paddle.distributed as dist

    from autoparallel import watchdog

    text = "" if error is None else f"{type(error).__name__}\0{error}"
    raw = text.encode()[:STATUS_BYTES]
    buf = np.zeros(STATUS_BYTES, dtype=np.uint8)
    buf[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    parts = []
    with watchdog.op(what):
        dist.all_gather(parts, paddle.to_tensor(buf))
    out = []
    for r, t in enumerate(parts):
        got = t.numpy().tobytes().rstrip(b"\0")
        if got:
            name, _, msg = got.decode(errors="replace").partition("\0")
            out.append((r, name, msg))
    return out


def share_outcome(what: str, error, error_type=None) -> None:
    """Every rank learns the outcome of a step that some ranks only performed (rank 0's ``latest`` pointer, its
    pruning, its metadata) before any rank goes on: a rank raising alone would leave the others in their next
    collective until gloo's 30 s timeout or the watchdog ends the job. One all_gather of every rank's status
    (gather_errors); if any rank failed, every rank raises ``error_type`` (CheckpointSaveError by default)
    saying ``what`` failed on which ranks and why. A KeyboardInterrupt or SystemExit is re-raised as itself on
    its own rank, after the others were told."""
    if error_type is None:
        from autoparallel.checkpoint.errors import CheckpointSaveError as error_type
    try:
        failures = gather_errors(error, f"{what} (status all_gather)")
    except RuntimeError as e:           # gloo: a peer that left the job's step (it raised before reaching here)
        if error is not None:
            raise error from None
        raise error_type(f"{what}: a rank did not take part in sharing its outcome (it left the save or restore "
                         f"before it): {e}") from None
    if not failures:
        return
    if error is not None and not isinstance(error, Exception):
        raise error
    raise error_type(f"{what} failed on " + "; ".join(f"rank {r}: {name}: {msg}" for r, name, msg in failures)) \
        from error


def rank_zero_step(what: str, fn, error_type=None):
    """Run ``fn()`` on rank 0 only (every rank calls this at the same point), then share its outcome with every
    rank (share_outcome). Returns ``fn``'s result on rank 0, None elsewhere."""
    _, rank, _ = job()
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except BaseException as e:      # KeyboardInterrupt too: the others must not wait for rank 0 in vain
            error = e
    share_outcome(what, error, error_type)
    return result


MAX_BYTES = 1 << 26                 # an answer longer than this is another collective's data, not a save's


def all_gather_json(obj) -> list:
    """Every rank's ``obj`` (JSON), by two all_gathers: the lengths, then the bytes padded to the longest."""
    import json

    import numpy as np
    import paddle
    import paddle.distributed as dist

    raw = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    sizes = []
    dist.all_gather(sizes, paddle.to_tensor([raw.size], dtype="int64"))
    widths = [int(t.numpy()[0]) for t in sizes]
    if not all(0 < w <= MAX_BYTES for w in widths):
        raise ValueError(f"the ranks' answers have sizes {widths} (expected 1..{MAX_BYTES} bytes)")
    width = max(widths)
    buf = np.zeros(width, dtype=np.uint8)
    buf[:raw.size] = raw
    parts = []
    dist.all_gather(parts, paddle.to_tensor(buf))
    return [json.loads(t.numpy()[:w].tobytes()) for t, w in zip(parts, widths)]   # ValueError if not JSON
