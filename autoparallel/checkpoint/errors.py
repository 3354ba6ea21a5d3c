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


class CheckpointOwnershipError(CheckpointError, FileExistsError):
    """A path holds something that is not this project's to replace or to write into: the user's files, a
    run root where a single checkpoint was expected, or another run's checkpoints. Nothing was changed."""


class CheckpointRootError(CheckpointError, OSError):
    """A checkpoint root cannot hold checkpoints: it is a file, cannot be created or written, or its
    filesystem lacks the space of one checkpoint. Found before the first training step."""


class CheckpointLayoutError(CheckpointError, FileNotFoundError):
    """A path holds checkpoints in a layout a load cannot take as one checkpoint (per-rank directories, each its
    own save; checkpoints one level down): the error names what was found and the call that loads it. Nothing
    was loaded."""


def shared_class(name: str):
    """The class another rank's failure of type ``name`` is raised as on this rank (an exchange carries type
    names): a checkpoint error or a common input error keeps its type, anything else is a CheckpointError."""
    known = (CheckpointRootError, CheckpointOwnershipError, CheckpointError, CheckpointMismatchError,
             CheckpointCorruptError, CheckpointLayoutError, FileNotFoundError, ValueError, TypeError)
    return next((c for c in known if c.__name__ == name), None)


def raise_first_failure(failures: list, fallback: str = None) -> None:
    """Raise the first failing rank's error of an exchange's ``failures`` ([(rank, type name, text)], as
    ``sync.gather_errors`` gives them): typed as there (``shared_class``), prefixed with that rank; a type the
    exchange cannot carry as a CheckpointError saying ``fallback`` (default: the type name and text). Nothing to
    raise without failures."""
    if not failures:
        return
    r, name, msg = failures[0]
    known = shared_class(name)
    if known is not None:
        raise known(f"(rank {r}) {msg}")
    raise CheckpointError(fallback or f"(rank {r}) {name}: {msg}")
