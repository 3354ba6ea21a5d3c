"""Before a multi-process save writes anything, its ranks check that they write into one directory.

The rendezvous of a real job goes through files (sync.py): rank 0 waits for every rank's marker in the
temporary directory, the others for rank 0's metadata. A path that names another directory on another rank --
a relative path under different working directories, or a node-local filesystem (``/tmp`` on each node) --
left every rank polling for files written elsewhere until ``AP_CKPT_TIMEOUT`` (an hour by default; every rank
alive, so the watchdog had no one to name), and a partial directory behind on every rank but rank 0's.

So every rank drops an empty probe file, ``.autoparallel-probe-<token>-r<rank>``, into the checkpoint's parent
directory before the save's exchange (save_agree.py), which carries each rank's absolute path and probe name.
After it, rank 0 looks for every rank's probe and every other rank for rank 0's (for up to ``VISIBLE_WAIT_S``:
a shared filesystem may show another client's new file late) and one more all_gather shares which ranks each
one could not see. Any unseen probe stops every rank with ``CheckpointSaveError`` naming who cannot see whom
(and the ranks' absolute paths when they differ: a relative path under different working directories), before
any rank writes. Paths that differ but name one directory (two mount points of a shared filesystem) pass, as
the rendezvous works there. A rank that cannot create its probe (a read-only directory) sends that error in
the exchange, raised on every rank.
"""
from __future__ import annotations

import os
import time

from autoparallel.checkpoint.errors import CheckpointRootError, CheckpointSaveError
from autoparallel.checkpoint.run_root import PROBE

VISIBLE_WAIT_S = 2.0                # how long a rank looks for a peer's probe before calling it unseen
POLL_S = 0.05                       # between two looks for the probes still unseen


def probe_path(final: str, token: str, rank: int) -> str:
    """The probe file of ``rank`` for a save to ``final`` (in its parent directory, next to the checkpoint)."""
    return os.path.join(os.path.dirname(final), f"{PROBE}{token}-r{rank:05d}")


def leave_probe(final: str, token: str, rank: int) -> str:
    """Create this rank's empty probe file; PermissionError (or the OSError met) naming the rank and directory
    if it cannot be created, which the exchange raises on every rank."""
    path = probe_path(final, token, rank)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as e:
        raise type(e)(e.errno, f"cannot save checkpoint {final!r}: rank {rank} cannot create a file in "
                               f"{os.path.dirname(final)!r}: {e.strerror}") from None
    return path


def remove_probe(path) -> None:
    """Best effort: a probe left by a failed removal is an empty hidden file a run root's inspection skips."""
    if path is None:
        return
    try:
        os.remove(path)
    except OSError:
        pass


def path_difference(finals: list) -> str:
    """A note on the ranks' absolute paths when they are not all the same ("" if they are). Paths that differ
    are no error by themselves (two mount points of one shared directory): only the probes decide."""
    if len(set(finals)) <= 1:
        return ""
    shown = ", ".join(f"rank {r}: {p}" for r, p in enumerate(finals))
    return f" The ranks' paths differ ({shown}): a relative path is resolved in each rank's working directory."


def unseen(probes: list, rank: int) -> list:
    """The ranks whose probe file this rank does not see in its own directory (the parent of ``probes[rank]``)
    within ``VISIBLE_WAIT_S``. Looked for by name in this rank's directory, not at the other rank's path: on one
    shared filesystem two ranks' different absolute paths both exist, and only this shows that they name two
    directories. Rank 0 looks for every rank's, the others for rank 0's -- what the rendezvous needs (rank 0 reads
    every rank's files, every rank rank 0's metadata), in 2 x (ranks - 1) lookups rather than ranks^2."""
    here = os.path.dirname(probes[rank])
    others = [r for r, p in enumerate(probes) if r != rank and (rank == 0 or r == 0) and isinstance(p, str)]
    deadline = time.monotonic() + VISIBLE_WAIT_S
    while True:
        missing = [r for r in others if not os.path.exists(os.path.join(here, os.path.basename(probes[r])))]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(POLL_S)


def check_visible(probes: list, label: str, rank: int, world_size: int, error=CheckpointSaveError,
                  paths: list = ()) -> None:
    """Every rank looks for the probes it needs (``unseen``), then one all_gather shares the result: ``error`` on
    every rank, its text starting with ``label`` (the save or root checked) and noting ``paths`` (each rank's
    absolute path) if they differ, when any rank could not see a probe."""
    import numpy as np
    import paddle
    import paddle.distributed as dist

    from autoparallel import watchdog

    flags = np.zeros(world_size, dtype=np.int32)
    flags[unseen(probes, rank)] = 1
    parts = []
    try:
        with watchdog.op("checkpoint start (shared directory check)"):
            dist.all_gather(parts, paddle.to_tensor(flags))
        seen = [t.numpy().reshape(-1) for t in parts]
        if len(seen) != world_size or any(s.shape != (world_size,) for s in seen):
            raise ValueError(f"expected {world_size} answers of {world_size} flags")
    except (RuntimeError, ValueError) as e:
        raise error(f"{label}: the ranks did not check its directory together (every rank of the job must reach "
                    f"this call at the same point): {e}") from None
    blind = {r: [int(s) for s in np.flatnonzero(f)] for r, f in enumerate(seen) if f.any()}
    if blind:
        who = "; ".join(f"rank {r} does not see the files of ranks {s}" for r, s in blind.items())
        raise error(
            f"{label}: {os.path.dirname(probes[rank])!r} is not one directory every rank sees: {who}."
            f"{path_difference(paths)} A multi-process save needs one directory on a filesystem shared by every "
            f"rank (not a node-local one such as /tmp on each node). No rank wrote any of the checkpoint")


def check_one_directory(directory: str) -> None:
    """The same check for a run root every rank of a real job will write into, before the first step: each
    rank's probe dropped in ``directory``, rank 0 seeing every rank's in its own and every rank rank 0's;
    CheckpointRootError on every rank otherwise (naming the ranks' paths when they differ). Nothing in one
    process or the simulated world."""
    from autoparallel import watchdog
    from autoparallel.checkpoint import sync
    from autoparallel.checkpoint.atomic import new_nonce

    multi, rank, world_size = sync.job()
    if not multi:
        return
    label = f"checkpoint root {directory!r}"
    probe = None
    try:
        probe = leave_probe(os.path.join(directory, "x"), new_nonce(), rank)   # the probe goes next to "x"
        error = None
    except OSError as e:
        error = str(e)
    try:
        try:
            with watchdog.op("checkpoint root check (all_gather)"):
                parts = sync.all_gather_json({"dir": directory, "probe": probe, "error": error})
        except (RuntimeError, ValueError) as e:
            raise CheckpointRootError(f"{label}: the ranks did not check it together: {e}") from None
        errors = [f"rank {r}: {p['error']}" for r, p in enumerate(parts) if p.get("error")]
        if errors:
            raise CheckpointRootError(f"{label}: " + "; ".join(errors))
        check_visible([p.get("probe") for p in parts], label, rank, world_size, CheckpointRootError,
                      [p.get("dir") for p in parts])
    finally:
        remove_probe(probe)
