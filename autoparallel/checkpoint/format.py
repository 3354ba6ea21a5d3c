"""On-disk format of one checkpoint directory.

```
<checkpoint>/
  metadata.json        written last by rank 0: global shapes, dtypes, placements, mesh, step, extra, the run
                       state (generators, loss scale, LR schedule), and for every shard its file, byte
                       offset, global box and per-block crc32 checksums
  data-r00003.bin      the raw C-order bytes of every shard rank 3 owns, each starting on a 64-byte
                       boundary; no header, so a loader reads any box with seek/pread (or np.memmap)
```

Every shard's bytes are cut into blocks of ``block_bytes`` (1 MiB), each with its own crc32, so a loader
that reads a few rows of a shard verifies only the blocks it reads. Each data file also has a whole-file
crc32 and size (``verify_checkpoint`` checks them all). ``metadata.json`` carries the crc32 of its own fields
(METADATA_CRC), checked on every read.
"""
from __future__ import annotations

import json
import os
import zlib

import numpy as np

FORMAT = "autoparallel.checkpoint"
VERSION = 1
METADATA = "metadata.json"
BLOCK_BYTES = 1 << 20
ALIGN = 64

# dtypes without a numpy equivalent are stored as their bit pattern
_STORAGE = {"bfloat16": np.dtype("uint16"), "bool": np.dtype("bool")}


def data_file_name(rank: int) -> str:
    return f"data-r{rank:05d}.bin"


def storage_dtype(dtype: str) -> np.dtype:
    return _STORAGE.get(dtype) or np.dtype(dtype)


def block_crcs(data: memoryview, block_bytes: int = BLOCK_BYTES) -> list:
    return [zlib.crc32(data[i:i + block_bytes]) for i in range(0, len(data), block_bytes)] or [zlib.crc32(b"")]


# metadata.json's own checksum: crc32 of the canonical JSON of every other field. The data files' block
# checksums do not cover the metadata, where one flipped bit of a shard's offsets ("0" -> "1") made a load
# assemble a wrong tensor without an error (rows shifted, one row zero), and one in a JSON value or the run
# state changed it unseen.
METADATA_CRC = "metadata_crc32"
# the fields of a metadata written before METADATA_CRC (still loaded, unverified); any other field without
# METADATA_CRC is refused, so a flipped bit in that key's name cannot switch the check off
FIELDS = {"format", "version", "step", "extra", "runtime", "nonce", "world_size", "created", "tensors", "values",
          "files", "runtime_tensors"}


def metadata_crc(meta: dict) -> int:
    """crc32 of the canonical JSON (sorted keys, no spaces) of ``meta`` without its METADATA_CRC field: the
    same before writing and after parsing (JSON numbers and strings round-trip exactly)."""
    body = {k: v for k, v in meta.items() if k != METADATA_CRC}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def encode_metadata(meta: dict) -> bytes:
    """metadata.json's bytes: ``meta`` with its checksum as the last field ("format" stays first: ownership.py
    recognises a checkpoint by its first bytes)."""
    plain = json.loads(json.dumps(meta))        # as a reader parses it (JSON keys are strings, tuples lists)
    return json.dumps({**plain, METADATA_CRC: metadata_crc(plain)}, indent=1).encode()


def check_metadata_crc(meta: dict, path: str) -> None:
    """CheckpointCorruptError unless ``meta``'s checksum matches its fields (or it predates the checksum)."""
    from autoparallel.checkpoint.errors import CheckpointCorruptError

    if METADATA_CRC not in meta:
        unknown = sorted(set(meta) - FIELDS)
        if unknown:
            raise CheckpointCorruptError(f"{path}: unknown checkpoint metadata fields {unknown} and no "
                                         f"{METADATA_CRC!r}: the file was modified after it was written")
        return
    want, got = meta[METADATA_CRC], metadata_crc(meta)
    if want != got:
        shown = f"{want:#010x}" if isinstance(want, int) and not isinstance(want, bool) else repr(want)
        raise CheckpointCorruptError(f"{path}: metadata checksum mismatch (crc32 {got:#010x} of its fields, the "
                                     f"file records {shown}): the file was modified after it was written")


def read_metadata(ckpt_dir: str) -> dict:
    from autoparallel.checkpoint.errors import CheckpointCorruptError

    path = os.path.join(ckpt_dir, METADATA)
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read())
    except FileNotFoundError:
        raise FileNotFoundError(f"{ckpt_dir!r} is not a complete checkpoint: {METADATA} is missing") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointCorruptError(f"{path}: unreadable checkpoint metadata ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{path}: not an autoparallel checkpoint (expected format {FORMAT!r}, "
                                     f"got {meta.get('format') if isinstance(meta, dict) else type(meta).__name__!r})")
    if meta.get("version") != VERSION:
        raise CheckpointCorruptError(f"{path}: checkpoint format version {meta.get('version')!r} is not "
                                     f"supported (this version reads {VERSION})")
    from autoparallel.checkpoint.schema import validate_metadata

    validate_metadata(meta, path)               # names the malformed field first
    check_metadata_crc(meta, path)
    return meta
