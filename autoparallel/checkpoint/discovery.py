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


def newest_complete(root: str):
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str) -> str:
    """``path`` itself if it is a complete checkpoint, else the newest complete one under it."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a checkpoint path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}: the path does not exist")
    if os.path.isfile(path):
        if os.path.basename(path) == METADATA:
            return resolve_checkpoint(os.path.dirname(path))
        raise FileNotFoundError(f"{path!r} is a file, expected a checkpoint directory (holding {METADATA}) or a "
                                f"directory of step-<n> checkpoints")
    if is_temp_name(os.path.basename(path)):
        raise FileNotFoundError(f"{path!r} is an unfinished checkpoint (a save was interrupted); load the "
                                f"directory holding it to get the newest complete checkpoint")
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    newest = newest_complete(path)
    if newest is None:
        partial = [os.path.basename(p) for p in incomplete_checkpoints(path)]
        hint = f"; unfinished saves: {partial}" if partial else ""
        raise FileNotFoundError(f"no complete checkpoint in {path!r}: expected {METADATA} in it or complete "
                                f"step-<n> sub-directories{hint}")
    return newest
