"""Crash-safe file operations and the named fault-injection points of a save.

A save writes everything under ``<final>.tmp-<nonce>``, fsyncs every file and the directory, then renames
the directory to its final name and fsyncs the parent: a checkpoint directory under its final name is
complete by construction, and the previous checkpoint stays valid until the rename.

Fault injection (tests): ``AP_CKPT_FAULT=<phase>[,<phase>...]`` makes the writer SIGKILL itself when it
reaches that phase (``AP_CKPT_FAULT_RANK=<r>`` restricts it to one rank's writer); ``<phase>:enospc`` raises
``OSError(ENOSPC)`` there instead, as a full disk would (the save then removes its temporary directory).
Phases, in order:

* ``shard_half_written``      half of the first shard's bytes are in the data file
* ``shard_before_fsync``      a data file is fully written, not yet fsynced
* ``before_metadata_rename``  ``metadata.json.tmp`` is written and fsynced inside the temporary directory
* ``after_metadata_rename``   ``metadata.json`` is in place, the directory still has its temporary name
* ``after_dir_rename``        the checkpoint has its final name; the manager's ``latest`` pointer is not updated
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import uuid

PHASES = ("shard_half_written", "shard_before_fsync", "before_metadata_rename", "after_metadata_rename",
          "after_dir_rename")
TMP_MARK = ".tmp-"


def fault_point(phase: str, rank: int = 0) -> None:
    """SIGKILL this process (or raise ENOSPC) if ``AP_CKPT_FAULT`` names ``phase`` (and ``AP_CKPT_FAULT_RANK``
    allows it)."""
    if phase not in PHASES:
        raise ValueError(f"unknown fault phase {phase!r}: expected one of {PHASES}")
    wanted = os.environ.get("AP_CKPT_FAULT", "")
    modes = dict((w.strip().split(":", 1) + ["kill"])[:2] for w in wanted.split(",") if w.strip())
    if phase not in modes:
        return
    only = os.environ.get("AP_CKPT_FAULT_RANK")
    if only not in (None, "") and int(only) != rank:
        return
    if modes[phase] == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {phase})")
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def new_nonce() -> str:
    return uuid.uuid4().hex[:12]


def temp_dir_for(final: str, nonce: str) -> str:
    return f"{os.path.normpath(final)}{TMP_MARK}{nonce}"


def is_temp_name(name: str) -> bool:
    return TMP_MARK in name


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: str, data: bytes, before_rename=None) -> None:
    """Write ``path`` through ``path.tmp`` + fsync + rename + fsync of the directory."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if before_rename is not None:
        before_rename()
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def is_empty_dir(path: str) -> bool:
    """An existing, empty, real directory (``tempfile.mkdtemp()``): a save may take its place, as paddle's
    ``save_state_dict`` writes into it."""
    return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)


def publish_dir(tmp: str, final: str, overwrite: bool) -> None:
    """Rename the finished temporary directory to ``final`` (atomically when ``final`` does not exist).

    With ``overwrite`` an existing ``final`` (checked again to be a checkpoint of ours) is first moved aside to
    ``<final>.tmp-old-<nonce>`` and removed after the rename: a crash in between leaves the new checkpoint
    complete or the old one recoverable (the manager's start-up puts it back); a failed rename puts it back.
    """
    from autoparallel.checkpoint.ownership import check_replaceable

    fsync_dir(tmp)
    parent = os.path.dirname(os.path.abspath(final))
    aside = None
    if os.path.lexists(final) and not is_empty_dir(final):      # an empty directory is replaced by the rename
        if not overwrite:
            raise FileExistsError(f"checkpoint {final!r} already exists; pass overwrite=True to replace it")
        check_replaceable(final)
        aside = temp_dir_for(final, "old-" + new_nonce())
        os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        if aside is not None:
            os.rename(aside, final)
        raise
    fsync_dir(parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
