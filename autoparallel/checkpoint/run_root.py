"""A run root (``CheckpointManager.dir``, ``--ckpt-dir``) belongs to one training run.

``CheckpointManager.start`` runs these checks before the first training step, on every rank:

* **usable**: the root is a directory or can be created, a file can be created in it, and its filesystem
  has the free space of one checkpoint (estimated from the state: every global element once, plus the
  metadata); otherwise CheckpointRootError.
* **one run**: a new run (``resume=False``) needs a root that holds no checkpoint and nothing else of the
  user's; a root with another run's checkpoints is refused (CheckpointOwnershipError naming its steps)
  rather than silently mixed with them, and so is a non-empty directory that is not a run root of ours.
  The run root is then marked (``.autoparallel-run``).
* **tidy**: temporary directories a save of ours left behind (a crash, a kill) are removed; an old
  checkpoint moved aside by an overwrite that was interrupted is put back; ``latest`` is rewritten to name
  the newest complete checkpoint, the one ``--resume`` loads.

Every rank checks that it can write there, then that the root is one directory every rank sees (the same
absolute path, each rank's probe file visible to every other: shared_dir.py), then rank 0 inspects, tidies and
marks the root; after each step the ranks agree through one all_gather, so every rank raises the same error or
none does.
"""
from __future__ import annotations

import json
import os
import shutil
import time

from autoparallel.checkpoint.atomic import write_file_atomic
from autoparallel.checkpoint.discovery import complete_checkpoints
from autoparallel.checkpoint.errors import CheckpointOwnershipError, CheckpointRootError, raise_first_failure
from autoparallel.checkpoint.ownership import (RUN_MARKER, STEP_DIR, TEMP_DIR, is_owned_partial, marker_bytes,
                                               not_a_checkpoint, read_marker)

LATEST = "latest"
PROBE = ".autoparallel-probe-"
OVERHEAD_BYTES = 1 << 20           # metadata, generator states, alignment: added to the tensors' bytes


# ---- usable -------------------------------------------------------------------------------------------
def free_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


def estimate_bytes(state) -> int:
    """Bytes of one checkpoint of ``state``: each global element once, JSON values as text, plus overhead."""
    import numpy as np

    from autoparallel.checkpoint.flatten import flatten
    from autoparallel.checkpoint.format import storage_dtype
    from autoparallel.checkpoint.layout import numel

    if state is None:
        return 0
    total = OVERHEAD_BYTES
    for _, _, leaf in flatten(state).values():
        shape_dtype = _shape_dtype(leaf)
        if shape_dtype is not None:
            shape, dtype = shape_dtype
            total += numel(shape) * storage_dtype(dtype).itemsize
        elif not isinstance(leaf, np.ndarray):
            total += len(json.dumps(leaf, default=str))
        else:
            total += leaf.nbytes
    return total


def _shape_dtype(leaf):
    import paddle

    from autoparallel.checkpoint.leaves import ShardedLeaf
    from autoparallel.dist_tensor import DistTensor, as_dist, is_dist
    from autoparallel.spec import normalize_dtype

    if isinstance(leaf, ShardedLeaf):
        return tuple(leaf.shape), leaf.dtype
    if isinstance(leaf, DistTensor) or is_dist(leaf):
        spec = as_dist(leaf).spec
        return tuple(spec.shape), spec.dtype
    if isinstance(leaf, paddle.Tensor):
        return tuple(leaf.shape), normalize_dtype(leaf.dtype)
    return None


def check_usable(root: str, need: int, rank: int) -> None:
    """CheckpointRootError unless ``root`` is (or can be made) a writable directory with ``need`` bytes free."""
    if os.path.lexists(root) and not os.path.isdir(root):
        raise CheckpointRootError(f"checkpoint root {root!r} is a file, expected a directory (or a path that "
                                  f"does not exist yet)")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise CheckpointRootError(f"checkpoint root {root!r} cannot be created: {e.strerror or e}") from None
    probe = os.path.join(root, f"{PROBE}r{rank:05d}-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
    except OSError as e:
        raise CheckpointRootError(f"checkpoint root {root!r} is not writable by rank {rank}: "
                                  f"{e.strerror or e}") from None
    finally:
        if os.path.exists(probe):
            os.remove(probe)
    free = free_bytes(root)
    if free < need:
        raise CheckpointRootError(f"checkpoint root {root!r}: one checkpoint of this state needs about "
                                  f"{_mib(need)}, its filesystem has {_mib(free)} free")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# ---- one run ------------------------------------------------------------------------------------------
def inspect(root: str) -> dict:
    """{"checkpoints": [(step, path)], "partials": [paths], "foreign": [names], "marker": dict | None}."""
    out = {"checkpoints": complete_checkpoints(root), "partials": [], "foreign": [],
           "marker": read_marker(root, RUN_MARKER)}
    complete = {os.path.basename(p) for _, p in out["checkpoints"]}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name in complete or name in (RUN_MARKER, LATEST, LATEST + ".tmp") or name.startswith(PROBE):
            continue
        if TEMP_DIR.search(name) and is_owned_partial(path):
            out["partials"].append(path)
        elif STEP_DIR.match(name) and not_a_checkpoint(path) is None and not os.listdir(path):
            out["partials"].append(path)                   # an empty step directory: nothing to keep
        else:
            out["foreign"].append(name)
    return out


def claim(root: str, resume: bool) -> None:
    """Rank 0: refuse a root that is not this run's to write, then tidy and mark it (module docstring)."""
    found = inspect(root)
    steps = [s for s, _ in found["checkpoints"]]
    if found["foreign"] and (found["marker"] is None or not resume):
        what = "a run root" if found["marker"] else "not a checkpoint run root"
        raise CheckpointOwnershipError(
            f"checkpoint root {root!r} holds entries that are not checkpoints of this run ({what}): "
            f"{found['foreign'][:8]}; a run writes into an empty or new directory, or continues its own run "
            f"root with --resume. Nothing was changed")
    if steps and not resume:
        raise CheckpointOwnershipError(
            f"checkpoint root {root!r} already holds the checkpoints of a run (steps {steps[:3]}"
            f"{'...' if len(steps) > 3 else ''}, newest {steps[-1]}): pass --resume "
            f"(CheckpointManager.start(resume=True) / restore) to continue it, or give the new run its own "
            f"directory. Nothing was changed")
    tidy(root, found["partials"])
    if found["marker"] is None:
        write_file_atomic(os.path.join(root, RUN_MARKER), marker_bytes("run", created=time.time()))
    write_latest(root)


def tidy(root: str, partials: list) -> None:
    """Remove our leftover temporary directories; an interrupted overwrite's old checkpoint is put back."""
    for path in partials:
        name = os.path.basename(path)
        final = os.path.join(root, TEMP_DIR.split(name)[0]) if TEMP_DIR.search(name) else None
        if final and ".tmp-old-" in name and not os.path.lexists(final) and os.path.isfile(
                os.path.join(path, "metadata.json")):
            os.rename(path, final)
        else:
            shutil.rmtree(path, ignore_errors=True)


def write_latest(root: str) -> None:
    """``latest`` names the newest complete checkpoint (removed when there is none): what resume loads."""
    found = complete_checkpoints(root)
    path = os.path.join(root, LATEST)
    if not found:
        if os.path.lexists(path):
            os.remove(path)
        return
    text = os.path.basename(found[-1][1]) + "\n"
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    write_file_atomic(path, text.encode())


# ---- agreement ------------------------------------------------------------------------------------------
def agree(error) -> None:
    """Raise on every rank if any rank has an ``error``: its own on that rank, the first failing rank's on the
    others (prefixed with that rank; a type the exchange cannot carry, a Ctrl-C, as a CheckpointError naming it)."""
    from autoparallel.checkpoint import sync

    failures = sync.gather_errors(error, "checkpoint root check (all_gather)")
    if error is not None:
        raise error
    raise_first_failure(failures)
