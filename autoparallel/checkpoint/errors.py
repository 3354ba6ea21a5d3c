"""Typed checkpoint errors: each names the file, tensor or key at fault and says what was expected."""
from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every checkpoint error."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is truncated, tampered with or unreadable (checksum or size mismatch)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint and the target state disagree (names, shapes, dtypes, kinds); nothing was loaded."""


class CheckpointSaveError(CheckpointError):
    """A distributed save could not complete (a rank did not finish writing in time, or a commit failed)."""
