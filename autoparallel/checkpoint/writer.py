"""Write the shards one rank owns into its data file (raw bytes, 64-byte aligned, block checksums)."""
from __future__ import annotations

import os
import zlib

import numpy as np

from autoparallel.checkpoint.atomic import fault_point
from autoparallel.checkpoint.format import ALIGN, BLOCK_BYTES, block_crcs, data_file_name


def write_rank_file(directory: str, rank: int, items: list, block_bytes: int = BLOCK_BYTES) -> tuple:
    """Write ``items`` = [(name, offsets, array)] to ``directory/data-r<rank>.bin``, fsync it.

    Returns (entries, file_info): entries[name] lists shard records (file, byte offset, box, block crcs);
    file_info is {"name", "size", "crc32"} of the whole file.
    """
    fname = data_file_name(rank)
    path = os.path.join(directory, fname)
    entries: dict = {}
    pos = 0
    file_crc = 0
    with open(path, "wb") as f:
        for index, (name, offsets, array) in enumerate(items):
            data = memoryview(np.require(array, requirements="C").reshape(-1).view(np.uint8))
            pad = (-pos) % ALIGN
            if pad:
                f.write(b"\0" * pad)
                file_crc = zlib.crc32(b"\0" * pad, file_crc)
                pos += pad
            if index == 0:
                half = len(data) // 2
                f.write(data[:half])
                f.flush()
                fault_point("shard_half_written", rank)
                f.write(data[half:])
            else:
                f.write(data)
            file_crc = zlib.crc32(data, file_crc)
            entries.setdefault(name, []).append({
                "file": fname, "byte_offset": pos, "nbytes": len(data),
                "offsets": [int(o) for o in offsets], "shape": [int(s) for s in array.shape],
                "block_bytes": block_bytes, "crc32": block_crcs(data, block_bytes),
            })
            pos += len(data)
        f.flush()
        fault_point("shard_before_fsync", rank)
        os.fsync(f.fileno())
    return entries, {"name": fname, "size": pos, "crc32": file_crc}
