"""Find checkpoints: a checkpoint directory, or the newest complete one under a root directory.

A checkpoint is complete when its directory has its final name (no ``.tmp-`` part) and holds
``metadata.json``: saves build it under a temporary name and rename it last (atomic.py), so nothing else
needs checking. Under a root, ``step-<n>`` directories are ordered by n.
"""
from __future__ import annotations

import os
import re

from autoparallel.checkpoint.atomic import is_temp_name
from autoparallel.checkpoint.format import METADATA

STEP_DIR = re.compile(r"^step-(\d+)$")
RANK_DIR = re.compile(r"^rank[-_]?(\d+)$", re.IGNORECASE)     # rank0, rank_1, rank-00002: one rank's directory


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def is_complete(path: str) -> bool:
    return not is_temp_name(os.path.basename(os.path.normpath(path))) and os.path.isfile(os.path.join(path, METADATA))


def complete_checkpoints(root: str) -> list:
    """[(step, path)] of the complete ``step-<n>`` checkpoints under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and is_complete(path):
            out.append((int(m.group(1)), path))
    return sorted(out)


def incomplete_checkpoints(root: str) -> list:
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, n) for n in os.listdir(root) if is_temp_name(n))


ASIDE_DIR = re.compile(r"^step-(\d+)\.tmp-old-[0-9a-f]{12}$")
ASIDE = re.compile(r"^(.+)\.tmp-old-[0-9a-f]{12}$")


def is_committed_aside(path: str) -> bool:
    """A complete checkpoint that an overwrite moved aside (``<name>.tmp-old-<12 hex>``) and never put back:
    the overwrite was killed between its two renames, so ``<name>`` is missing and this is its committed
    checkpoint (the next ``CheckpointManager.start`` renames it back)."""
    path = os.path.normpath(path)
    m = ASIDE.match(os.path.basename(path))
    return bool(m) and os.path.isfile(os.path.join(path, METADATA)) and not os.path.lexists(
        os.path.join(os.path.dirname(path), m.group(1)))


def _aside_of(path: str):
    """The committed checkpoint of a missing ``path`` that an interrupted overwrite left aside, if any."""
    parent, name = os.path.split(os.path.normpath(path))
    if not os.path.isdir(parent):
        return None
    found = sorted(os.path.join(parent, n) for n in os.listdir(parent)
                   if n.startswith(name + ".tmp-old-") and is_committed_aside(os.path.join(parent, n)))
    return found[0] if len(found) == 1 else None


def newest_complete(root: str, with_aside: bool = False):
    """The newest complete checkpoint under ``root``; ``with_aside``: also one an interrupted overwrite left
    aside (what resume must load, before a start-up has put it back)."""
    found = complete_checkpoints(root)
    if with_aside and os.path.isdir(root):
        steps = {s for s, _ in found}
        for name in os.listdir(root):
            m = ASIDE_DIR.match(name)
            path = os.path.join(root, name)
            if m and int(m.group(1)) not in steps and is_committed_aside(path):
                found.append((int(m.group(1)), path))
        found.sort()
    return found[-1][1] if found else None


def resolve_checkpoint(path: str) -> str:
    """``path`` itself if it is a complete checkpoint, else the newest complete one under it."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a checkpoint path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        if _aside_of(path) is not None:
            return _aside_of(path)        # an overwrite of it was killed between its renames: still its content
        raise FileNotFoundError(f"no checkpoint at {path!r}: the path does not exist")
    if os.path.isfile(path):
        if os.path.basename(path) == METADATA:
            return resolve_checkpoint(os.path.dirname(path))
        raise FileNotFoundError(f"{path!r} is a file, expected a checkpoint directory (holding {METADATA}) or a "
                                f"directory of step-<n> checkpoints")
    if is_temp_name(os.path.basename(path)) and not is_committed_aside(path):
        raise FileNotFoundError(f"{path!r} is an unfinished checkpoint (a save was interrupted); load the "
                                f"directory holding it to get the newest complete checkpoint")
    _refuse_one_rank_of_many(path)
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    newest = newest_complete(path)
    if newest is None:
        _refuse_paddle_format(path)
        refuse_nested(path)
        partial = [os.path.basename(p) for p in incomplete_checkpoints(path)]
        hint = f"; unfinished saves: {partial}" if partial else ""
        raise FileNotFoundError(f"no complete checkpoint in {path!r}: expected {METADATA} in it or complete "
                                f"step-<n> sub-directories{hint}")
    return newest


def _refuse_paddle_format(path: str) -> None:
    """A directory written by ``paddle.distributed.save_state_dict`` (``<n>.metadata`` + ``*.distcp``) gets an
    error saying so: its metadata is a pickle, which this package never loads (a checkpoint is data, never
    code), so it is converted once by paddle's own loader in a process that trusts it."""
    names = os.listdir(path)
    if any(n.endswith(".metadata") for n in names) and any(n.endswith(".distcp") for n in names):
        raise FileNotFoundError(
            f"{path!r} holds a checkpoint in paddle.distributed.save_state_dict's format (*.metadata, *.distcp), "
            f"not an autoparallel checkpoint: its metadata is a pickle, which autoparallel never loads. Convert it "
            f"once where its source is trusted: paddle.distributed.load_state_dict(state, {path!r}) into plain "
            f"tensors, then ap.save_state_dict(state, new_path)")


def holds(path: str):
    """What the directory ``path`` holds for a load: "a checkpoint", "a run root (steps [...])", or None."""
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, METADATA)):
        return "a checkpoint"
    steps = [s for s, _ in complete_checkpoints(path)]
    if steps:
        return f"a run root (steps {steps[:3]}{'...' if len(steps) > 3 else ''})"
    return None


def _loading_hint() -> str:
    return ("A checkpoint of autoparallel is one directory that every rank of a job writes together "
            "(ap.save_state_dict with the same path on every rank), and it loads into any layout; a run "
            "root is resumed with CheckpointManager(dir=<the run root>).restore(state) (or "
            "ap.load_state_dict(state, <the run root>)). Nothing was loaded")


def refuse_nested(path: str) -> None:
    """A directory with no checkpoint of its own but checkpoints or run roots one level down (per-rank
    directories, a parent of run roots): CheckpointLayoutError naming them, rather than a bare 'not found'
    and never a silent pick of one of them. Temporary directories of a save are no checkpoint to name."""
    found = [(n, holds(os.path.join(path, n))) for n in sorted(os.listdir(path)) if not is_temp_name(n)]
    found = [(n, what) for n, what in found if what is not None]
    if not found:
        return
    from autoparallel.checkpoint.errors import CheckpointLayoutError

    ranks = [n for n, _ in found if RANK_DIR.match(n)]
    listed = ", ".join(f"{n} ({what})" for n, what in found[:8]) + (" ..." if len(found) > 8 else "")
    if len(ranks) >= 2:
        raise CheckpointLayoutError(
            f"{path!r} holds per-rank directories, each its own save: {listed}. Each was written by one rank "
            f"alone, so none of them is the job's state and they are not loaded as one. " + _loading_hint())
    raise CheckpointLayoutError(f"{path!r} holds no checkpoint itself, but its sub-directories do: {listed}; "
                                f"pass the one to load. " + _loading_hint())


def _refuse_one_rank_of_many(path: str) -> None:
    """A rank's directory (``rank<r>``) next to other ranks' that hold saves too: one of per-rank saves, so
    loading it would fill every rank from rank r's save alone. CheckpointLayoutError naming the layout."""
    me = RANK_DIR.match(os.path.basename(path))
    if me is None or holds(path) is None:
        return
    parent = os.path.dirname(path)
    peers = sorted(n for n in os.listdir(parent) if RANK_DIR.match(n) and holds(os.path.join(parent, n)))
    if len(peers) < 2:
        return
    from autoparallel.checkpoint.errors import CheckpointLayoutError

    raise CheckpointLayoutError(
        f"{path!r} is one of the per-rank directories {peers[:8]}{' ...' if len(peers) > 8 else ''} in "
        f"{parent!r}, each its own save: loading it would fill this process from rank {int(me.group(1))}'s "
        f"save alone, a part of the job's state. " + _loading_hint())
