"""How the ranks of a real job agree during a save, without ever waiting inside a gloo collective.

gloo (paddle 3.3.1) aborts a collective after a fixed 30 s, and writing a large shard can take longer, so
ranks never wait for each other in a collective around the writes. The protocol is:

1. one small broadcast before writing (rank 0's nonce: the name of the temporary directory);
2. every rank writes its own data file, fsyncs it, and atomically drops ``rank-<r>.json`` (its shard index)
   into the temporary directory;
3. rank 0 polls the directory until every rank's marker is there (a file-based rendezvous: no timeout but
   ``AP_CKPT_TIMEOUT``, default 3600 s), writes the metadata and commits;
4. the other ranks poll for the committed metadata carrying the same nonce (or a failure note).

All polling runs inside ``watchdog.long_wait`` so a running watchdog does not mistake it for a hang; the
watchdog still detects a rank that dies meanwhile. The checkpoint directory must be on a filesystem every
rank sees (a shared filesystem across nodes).
"""
from __future__ import annotations

import os
import time

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
    """Rank 0's ``token`` (12 hex digits) on every rank, by one broadcast of a 2-element int64 tensor."""
    multi, _, _ = job()
    if not multi:
        return token
    import paddle
    import paddle.distributed as dist

    value = int(token, 16)
    t = paddle.to_tensor([value >> 32, value & 0xFFFFFFFF], dtype="int64")
    dist.broadcast(t, src=0)
    hi, lo = (int(v) for v in t.numpy())
    return f"{(hi << 32) | lo:012x}"


def save_timeout() -> float:
    return float(os.environ.get("AP_CKPT_TIMEOUT", "3600"))


def wait_until(ready, timeout: float, describe) -> None:
    """Poll ``ready()`` until true; TimeoutError with ``describe()`` after ``timeout`` seconds."""
    from autoparallel import watchdog

    deadline = time.monotonic() + timeout
    delay = POLL_S
    with watchdog.long_wait("checkpoint rendezvous"):
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(describe())
            time.sleep(delay)
            delay = min(delay * 1.5, MAX_POLL_S)
