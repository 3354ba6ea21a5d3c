"""Which directories are this project's to replace or remove: checkpoints carry a marker file.

Every checkpoint directory holds ``.autoparallel-checkpoint`` (written first, into the temporary directory of
a save) and every run root a ``.autoparallel-run``. A directory is *a single checkpoint of ours* when it
has the checkpoint marker (or, for checkpoints written before markers, a ``metadata.json`` of this format)
and every entry in it is a file a save writes. Only such a directory is replaced by
``save_state_dict(..., overwrite=True)``, and only temporary directories of ours are ever removed; anything
else is refused with a CheckpointOwnershipError naming what was found, and left as it was.
"""
from __future__ import annotations

import json
import os
import re

from autoparallel.checkpoint.errors import CheckpointOwnershipError
from autoparallel.checkpoint.format import FORMAT, METADATA

CKPT_MARKER = ".autoparallel-checkpoint"
RUN_MARKER = ".autoparallel-run"
STEP_DIR = re.compile(r"^step-\d+$")
TEMP_DIR = re.compile(r"\.tmp-(old-)?[0-9a-f]{12}$")
# every name a save writes inside a checkpoint directory (final or temporary)
_CKPT_ENTRY = re.compile(r"^(metadata\.json|data-r\d{5}\.bin|rank-\d{5}\.json(\.failed)?|FAILED|ack-\d{5}|"
                         r"\.autoparallel-checkpoint)(\.tmp)?$")
_SHOW = 8


def marker_bytes(kind: str, **fields) -> bytes:
    return json.dumps({"format": FORMAT, "kind": kind, **fields}).encode()


def read_marker(directory: str, name: str):
    """The JSON of a marker file of ours, or None (absent, unreadable or not of this format)."""
    try:
        with open(os.path.join(directory, name), "rb") as f:
            data = json.loads(f.read(4096))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def _has_our_metadata(directory: str) -> bool:
    try:
        with open(os.path.join(directory, METADATA), "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    return f'"format": "{FORMAT}"'.encode() in head


def foreign_entries(directory: str) -> list:
    """Entries of ``directory`` that no save writes."""
    return sorted(n for n in os.listdir(directory) if not _CKPT_ENTRY.match(n)
                  or os.path.isdir(os.path.join(directory, n)))


def _show(names: list) -> str:
    return str(names[:_SHOW]) + (f" and {len(names) - _SHOW} more" if len(names) > _SHOW else "")


def not_a_checkpoint(path: str):
    """Why ``path`` is not a single checkpoint directory of ours (None if it is one, or an empty directory)."""
    if os.path.islink(path):
        return f"is a symbolic link (to {os.readlink(path)!r})"
    if not os.path.isdir(path):
        return "is a file" if os.path.exists(path) else None
    entries = os.listdir(path)
    if not entries:
        return None
    if RUN_MARKER in entries or any(STEP_DIR.match(n) for n in entries):
        steps = sorted(n for n in entries if STEP_DIR.match(n))
        return f"is a checkpoint run root (a CheckpointManager directory holding {_show(steps)})"
    if CKPT_MARKER not in entries and not _has_our_metadata(path):
        return (f"is not a checkpoint written by autoparallel (no {CKPT_MARKER} marker); it holds "
                f"{_show(sorted(entries))}")
    foreign = foreign_entries(path)
    if foreign:
        return f"is a checkpoint that also holds entries no save writes: {_show(foreign)}"
    return None


def check_replaceable(path: str) -> None:
    """Raise CheckpointOwnershipError unless ``path`` is absent, empty, or a single checkpoint of ours."""
    why = not_a_checkpoint(path)
    if why is not None:
        raise CheckpointOwnershipError(f"refusing to replace {path!r}: it {why}. overwrite=True replaces only a "
                                       f"single checkpoint directory written by autoparallel; nothing was changed")


def is_owned_partial(path: str) -> bool:
    """A temporary directory a save of ours left (``<name>.tmp-<12 hex>`` or ``.tmp-old-<12 hex>``) holding
    nothing but files a save writes."""
    if not TEMP_DIR.search(os.path.basename(path)) or os.path.islink(path) or not os.path.isdir(path):
        return False
    return not foreign_entries(path)
