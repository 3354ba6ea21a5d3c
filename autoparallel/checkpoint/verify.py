"""``verify_checkpoint``: check every data file of a checkpoint end to end (size and whole-file crc32)."""
from __future__ import annotations

import os
import zlib

from autoparallel.checkpoint.discovery import resolve_checkpoint
from autoparallel.checkpoint.errors import CheckpointCorruptError
from autoparallel.checkpoint.format import read_metadata

_CHUNK = 8 << 20


def verify_checkpoint(path: str) -> str:
    """Raise CheckpointCorruptError naming the first bad file; returns the checkpoint directory."""
    ckpt = resolve_checkpoint(path)
    meta = read_metadata(ckpt)
    for fname, info in meta["files"].items():
        fpath = os.path.join(ckpt, fname)
        if not os.path.isfile(fpath):
            raise CheckpointCorruptError(f"{fpath}: data file missing")
        size = os.path.getsize(fpath)
        if size != info["size"]:
            raise CheckpointCorruptError(f"{fpath}: data file is {size} bytes, the metadata expects {info['size']}")
        crc = 0
        with open(fpath, "rb") as f:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
        if crc != info["crc32"]:
            raise CheckpointCorruptError(f"{fpath}: whole-file checksum mismatch (crc32 {crc:#010x}, the metadata "
                                         f"expects {info['crc32']:#010x})")
    return ckpt
